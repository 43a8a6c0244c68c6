"""The LoRA section of a recipe (docs/lora.md, docs/qlora.md): LoRA, DoRA and the 4-bit (QLoRA) base."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_fsdp2.config.plans import LoraSettings, check


@dataclass(kw_only=True)
class PeftArgs:
    """LoRA through PEFT (docs/lora.md): the adapter goes to output_dir, the merged model to output_dir/merged."""

    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"], metadata={"help": "Module names, or all-linear."}
    )
    lora_target_parameters: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Parameters that take LoRA through PEFT's target_parameters (TRL's key): names or suffixes of "
            "2-D/3-D weights (mlp.experts.gate_up_proj), or all-experts: every fused MoE expert weight "
            "(docs/lora.md). Needs lora_dropout=0."
        },
    )
    lora_modules_to_save: list[str] = field(
        default_factory=list, metadata={"help": "Modules trained in full beside the adapter (e.g. lm_head)."}
    )
    use_rslora: bool = field(
        default=False, metadata={"help": "rsLoRA scaling alpha/sqrt(r) instead of alpha/r."}
    )
    merge_adapter: bool = field(
        default=False, metadata={"help": "Also export the merged full model to <output_dir>/merged."}
    )
    use_dora: bool = field(
        default=False,
        metadata={
            "help": "DoRA: a trained magnitude per output feature beside the LoRA direction (PEFT's use_dora)."
        },
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "QLoRA: the decoder layers' linear weights frozen in 4-bit NF4, sharded by FSDP2 (docs/qlora.md); "
            "needs use_peft=true."
        },
    )
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "4-bit data type (BitsAndBytesConfig's key): nf4."}
    )
    bnb_4bit_use_double_quant: bool = field(
        default=True, metadata={"help": "Quantise the 4-bit block scales too (QLoRA's double quantisation)."}
    )
    bnb_4bit_compute_dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype the 4-bit weights are dequantised to for compute; unset = the run's compute dtype "
            "(mixed_precision's, else torch_dtype), the only value accepted."
        },
    )

    def lora_settings(self) -> LoraSettings:
        return LoraSettings(
            r=self.lora_r,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            target_modules=self.lora_target_modules,
            target_parameters=list(self.lora_target_parameters) or None,
            modules_to_save=self.lora_modules_to_save or None,
            use_rslora=self.use_rslora,
            use_dora=self.use_dora,
        )

    def validate(self) -> None:
        """Raises ConfigError for a value argparse cannot refuse."""
        check(self.lora_r >= 1, f"lora_r={self.lora_r} must be >= 1")
        check(0 <= self.lora_dropout < 1, f"lora_dropout={self.lora_dropout} must be in [0, 1)")
        check(
            bool(self.lora_target_modules) or bool(self.lora_target_parameters),
            "lora_target_modules is empty and so is lora_target_parameters; give module names or all-linear (or "
            "parameters: all-experts)",
        )
        check(not self.merge_adapter or self.use_peft, "merge_adapter=true needs use_peft=true")
        check(
            not self.lora_target_parameters or self.use_peft,
            f"lora_target_parameters={self.lora_target_parameters} needs use_peft=true",
        )
        check(
            not self.lora_target_parameters or self.lora_dropout == 0,
            f"lora_target_parameters={self.lora_target_parameters} with lora_dropout={self.lora_dropout}: LoRA on a "
            "parameter (PEFT's ParamWrapper) adds B @ A to the weight itself, so there is no adapter input to drop "
            "out; set lora_dropout: 0",
        )
        check(
            not self.lora_target_parameters or not self.use_dora,
            f"lora_target_parameters={self.lora_target_parameters} with use_dora=true: PEFT has no DoRA for LoRA on "
            "parameters (its ParamWrapper); set use_dora: false or leave lora_target_parameters empty",
        )
        check(
            not self.use_dora or self.use_peft,
            "use_dora=true needs use_peft=true (DoRA is a kind of LoRA adapter)",
        )
        check(
            not self.load_in_4bit or self.use_peft,
            "load_in_4bit=true with use_peft=false: 4-bit weights are frozen and cannot be trained in full; set "
            "use_peft=true (QLoRA: LoRA adapters over the 4-bit base) or load_in_4bit=false",
        )
        check(
            self.bnb_4bit_quant_type == "nf4",
            f"bnb_4bit_quant_type={self.bnb_4bit_quant_type!r}: only 'nf4' is supported (the NF4 tensor that FSDP2 "
            "shards, docs/qlora.md); set bnb_4bit_quant_type: nf4",
        )
        check(
            self.bnb_4bit_use_double_quant or not self.load_in_4bit,
            "bnb_4bit_use_double_quant=false: the NF4 tensor that FSDP2 shards always quantises its block scales "
            "(0.5 bit per weight less than plain scales); remove the key or set it to true",
        )
