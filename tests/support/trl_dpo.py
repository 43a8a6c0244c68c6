"""Run TRL's ``DPOTrainer``, ``KTOTrainer`` or ``RewardTrainer``, or its ``CPOTrainer(loss_type="simpo")`` / ``ORPOTrainer``
(``trl.experimental``),
deterministically (fp32, dataset order, constant LR, a log line per step) and write its per-step metrics as JSON: the
reference the DPO recipe's parity tests compare against.

    python tests/support/trl_dpo.py MODEL DATA.jsonl OUT.json --batch 2 --accum 2 --steps 3 --lr 1e-2 \
        --beta 0.1 --loss_type sigmoid [--precompute]
    python tests/support/trl_dpo.py MODEL DATA.jsonl OUT.json --objective orpo --batch 4 --beta 0.5
    python tests/support/trl_dpo.py MODEL DATA.jsonl OUT.json --objective simpo --simpo_gamma 0.3 --cpo_alpha 0.5
    python tests/support/trl_dpo.py MODEL UNPAIRED.jsonl OUT.json --objective kto --batch 4 --loss_type kto \
        --desirable_weight 1.5
    python tests/support/trl_dpo.py MODEL DATA.jsonl OUT.json --objective rm --batch 4 --center 0.01
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--objective", choices=["dpo", "simpo", "orpo", "kto", "rm"], default="dpo")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss_type", default="sigmoid")
    parser.add_argument("--label_smoothing", type=float, default=0.0)
    parser.add_argument("--simpo_gamma", type=float, default=0.5)
    parser.add_argument("--cpo_alpha", type=float, default=0.0)
    parser.add_argument("--desirable_weight", type=float, default=1.0)
    parser.add_argument("--undesirable_weight", type=float, default=1.0)
    parser.add_argument("--center", type=float, default=None)  # RewardConfig.center_rewards_coefficient
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--precompute", action="store_true")
    args = parser.parse_args()

    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = datasets.load_dataset("json", data_files=args.data, split="train")
    common = dict(
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        beta=args.beta,
        max_length=args.max_length,
        disable_dropout=True,
        report_to="none",
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        if args.objective == "dpo":
            from trl import DPOConfig, DPOTrainer

            config = DPOConfig(
                output_dir=tmp,
                loss_type=[args.loss_type],
                label_smoothing=args.label_smoothing,
                precompute_ref_log_probs=args.precompute,
                **common,
            )
            # The model as a path: the policy and TRL's own reference are both loaded from it in fp32.
            trainer = DPOTrainer(
                model=args.model, args=config, train_dataset=data, processing_class=tokenizer
            )
        elif args.objective == "rm":
            from trl import RewardConfig, RewardTrainer

            common.pop("beta")
            config = RewardConfig(output_dir=tmp, center_rewards_coefficient=args.center, **common)
            # The model as a path: TRL seeds, then adds the score head (our recipe seeds the head the same way).
            trainer = RewardTrainer(
                model=args.model, args=config, train_dataset=data, processing_class=tokenizer
            )
        elif args.objective == "kto":
            from trl import KTOConfig, KTOTrainer

            config = KTOConfig(
                output_dir=tmp,
                loss_type=args.loss_type,
                desirable_weight=args.desirable_weight,
                undesirable_weight=args.undesirable_weight,
                precompute_ref_log_probs=args.precompute,
                **common,
            )
            trainer = KTOTrainer(
                model=args.model, args=config, train_dataset=data, processing_class=tokenizer
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
            if args.objective == "orpo":
                from trl.experimental.orpo import ORPOConfig, ORPOTrainer

                config = ORPOConfig(output_dir=tmp, remove_unused_columns=False, **common)
                trainer = ORPOTrainer(
                    model=model, args=config, train_dataset=data, processing_class=tokenizer
                )
            else:
                from trl.experimental.cpo import CPOConfig, CPOTrainer

                config = CPOConfig(
                    output_dir=tmp,
                    remove_unused_columns=False,
                    loss_type="simpo",
                    simpo_gamma=args.simpo_gamma,
                    cpo_alpha=args.cpo_alpha,
                    label_smoothing=args.label_smoothing,
                    **common,
                )
                trainer = CPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        history = [row for row in trainer.state.log_history if "loss" in row and "step" in row]
    with open(args.out, "w") as fh:
        json.dump(history, fh, indent=1)


if __name__ == "__main__":
    main()
