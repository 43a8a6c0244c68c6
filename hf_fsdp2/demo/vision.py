"""The vision-language demo: a SmolVLM-style composite built here, and an image task it cannot do before training.

No package of this toolkit's environments ships a small vision-language checkpoint (and the run reads no hub), so the
demo builds one the way SmolVLM was built: an ``Idefics3ForConditionalGeneration`` whose language model is the
embedded SmolLM2-135M-Instruct (its weights, tokenizer and ChatML template) and whose vision tower (a 2-layer
SigLIP-style encoder on 64-pixel images, 16 image tokens after the pixel shuffle) and connector are new, randomly
initialised: the demo trains them with the language model (``freeze_vision_tower`` / ``freeze_multi_modal_projector``
false). The task: the colour of a shape in a synthetic image drawn here with PIL (6 colours, 3 kinds of shape),
answered in one word, scored by exact match.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 230),
    "yellow": (235, 210, 30),
    "purple": (140, 50, 180),
    "orange": (245, 140, 20),
}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What colour is the shape?"
IMAGE_SIZE = 64

# ChatML as SmolLM2's, without its default system turn; an image part is the processor's <image> marker.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")


def draw_shape(colour: str, rng: random.Random) -> Any:
    """A white 64-pixel image with one large shape (a circle, square or triangle, 28-48 pixels) of ``colour``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    size = rng.randint(28, 48)
    x, y = rng.randint(0, IMAGE_SIZE - 1 - size), rng.randint(0, IMAGE_SIZE - 1 - size)
    box = (x, y, x + size, y + size)
    kind, fill = rng.choice(SHAPES), COLOURS[colour]
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
    return image


def make_vision_records(n: int, seed: int, split: str, folder: Path) -> list[dict[str, Any]]:
    """``n`` records asking the colour of the image's shape, the images written as PNG files under
    ``folder/img/<split>/`` and named by relative paths; the train and eval splits draw from different seeds."""
    rng = random.Random(f"hf_fsdp2.vision_demo:{split}:{seed}")
    (folder / "img" / split).mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        colour = rng.choice(list(COLOURS))
        path = f"img/{split}/{i}.png"
        draw_shape(colour, rng).save(folder / path)
        records.append(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                    {"role": "assistant", "content": [{"type": "text", "text": colour}]},
                ],
                "images": [path],
            }
        )
    return records


def write_vision_data(out_dir: Path, *, n_train: int, n_eval: int, seed: int) -> dict[str, Any]:
    """``out_dir/train.jsonl`` and ``eval.jsonl`` (images beside them); what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, n in (("train", n_train), ("eval", n_eval)):
        path = out_dir / f"{split}.jsonl"
        with path.open("w") as handle:
            for record in make_vision_records(n, seed, split, out_dir):
                handle.write(json.dumps(record) + "\n")
        written[split] = str(path)
    return {**written, "n_train": n_train, "n_eval": n_eval}


def build_smolvlm(text_dir: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """Save the demo's composite to ``out_dir`` (once: a folder with a config is returned as it is): SmolLM2 from
    ``text_dir`` as the language model, a new tower and connector seeded by ``seed``, the processor and template."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(_IMAGE_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    text_config = text.config.to_dict()
    text_config.update(vocab_size=len(tokenizer))
    config = transformers.Idefics3Config(
        text_config=text_config,
        vision_config=dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=IMAGE_SIZE,
            patch_size=8,
        ),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config)
    weights = text.model.state_dict()
    old = weights["embed_tokens.weight"]
    # The image tokens' rows: the mean of the others (they are never trained as targets).
    weights["embed_tokens.weight"] = torch.cat(
        [old, old.mean(0, keepdim=True).expand(len(tokenizer) - len(old), -1)]
    )
    model.model.text_model.load_state_dict(weights, strict=True)
    model.tie_weights()
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id
    )
    image_processor = transformers.Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=16, chat_template=CHAT_TEMPLATE
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _normalised(text: str) -> str:
    return text.strip().strip(".").strip().lower()


def evaluate_vision_folder(
    model_dir: Path, records: Sequence[dict[str, Any]], image_root: Path, *, batch_size: int = 20
) -> dict[str, float]:
    """Greedy answers of ``model_dir`` (fp32, CPU) to ``records`` (images read from ``image_root``): the exact match
    of the whole answer (case and a final period aside), and the answers' distinct values (a model that answers one
    colour to every image scores 1/6)."""
    import torch
    import transformers

    from hf_fsdp2.data.images import open_image, stored_image

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    hits: list[bool] = []
    given: set[str] = set()
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        texts = [processor.apply_chat_template(r["messages"][:-1], add_generation_prompt=True) for r in chunk]
        images = [[open_image(stored_image(p, image_root)) for p in r["images"]] for r in chunk]
        inputs = processor(
            text=texts, images=images, padding=True, return_tensors="pt", add_special_tokens=False
        )
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        answers = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for record, answer in zip(chunk, answers, strict=True):
            hits.append(_normalised(answer) == record["messages"][-1]["content"][0]["text"])
            given.add(_normalised(answer))
    return {"exact_match": sum(hits) / len(hits), "distinct_answers": len(given), "n": len(hits)}
