"""Image records to micro-batches, against TRL on the same raw records, and the model-side pieces of an image run.

- The padded batches of Gemma 3, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and Idefics3 (processors built in code), a text-only
  row among image rows, equal TRL's DataCollatorForVisionLanguageModeling's key by key (ids, mask, pixels, grids, token types,
  labels; neither builds position ids) with its assistant-only loss; with every token trained (chat_loss all / TRL's default) the labels differ from TRL's exactly
  at the image tokens, which never carry a loss here.
- String content takes its images before the first user text, as TRL places them; an image as a path, bytes, a PIL
  image or in an ``image`` column gives the same batch; bad records are refused by name.
- Truncation never cuts an image; Gemma 3's images in rows of several documents are refused by name (the other
  families' padding-free runs equal the padded ones in tests/distributed/test_vlm_2rank.py).
- A hub-like Qwen-VL folder (its torchvision video processor config included) loads without torchvision, its
  batches the code-built processor's; video records are refused by name.
- The tower runs once in every forward (a dummy image without images), taking a zero gradient from it; the image
  features are dropped from the model's output.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from support.composites import composite_config, save_vlm_processor, vlm_processor
from support.vlm import trl_batch, vlm_records

from hf_fsdp2.config import ConfigError
from hf_fsdp2.data.tokenize import tokenize_dataset
from hf_fsdp2.data.vision_collate import vision_collator
from hf_fsdp2.data.vision_encode import image_token_ids
from hf_fsdp2.labels import IGNORE_INDEX

# Gemma 3 (token types), Qwen2.5-VL and Qwen3-VL (patches, grids, Qwen3-VL's token types), Idefics3 (images per row);
# LLaVA's batches are checked through their losses against TRL's in tests/distributed/test_vlm_2rank.py. LLaVA's
# processor serves the record checks.
FAMILIES = ("gemma3_vlm", "qwen2_5_vl", "qwen3_vl", "qwen3_5_vlm", "idefics3", "llava")
COMPARED = ("gemma3_vlm", "qwen2_5_vl", "qwen3_vl", "qwen3_5_vlm", "idefics3")
# Idefics3's processor in transformers 5.25 cannot batch a text-only record beside image records (TRL fails on
# it): its batches compared here hold images in every row.
ROWS = {"idefics3": [0, 1, 3, 4]}


@pytest.fixture(scope="module")
def processors() -> dict[str, Any]:
    return {f: vlm_processor(f) for f in FAMILIES}


def _examples(processor: Any, records: list[dict[str, Any]], **kwargs: Any) -> datasets.Dataset:
    examples, _ = tokenize_dataset(
        datasets.Dataset.from_list(records),
        processor.tokenizer,
        max_length=512,
        processor=processor,
        **kwargs,
    )
    return examples


@pytest.mark.parametrize("family", COMPARED)
def test_padded_batches_equal_trls_on_the_same_records(processors: dict[str, Any], family: str) -> None:
    processor, records = processors[family], vlm_records()
    rows = ROWS.get(family, [0, 1, 2, 3])
    collator = vision_collator(
        processor, composite_config(family), pad_token_id=processor.tokenizer.pad_token_id, packing=False,
        padding_free=False,
    )  # fmt: skip
    ours = collator([_examples(processor, records)[i] for i in rows])
    theirs = trl_batch(processor, [records[i] for i in rows])
    # A text-only row between image rows (but Idefics3's, whose processor cannot batch one: TRL fails on it).
    assert family == "idefics3" or any(not records[i]["images"] for i in rows)
    # TRL 1.16's vision collator builds no position ids (it refuses padding-free batches for VLMs); the model makes
    # a padded batch's own (Qwen's 3-D ones from the grids), so neither batch carries them.
    assert set(ours) == set(theirs) and "position_ids" not in ours, (sorted(ours), sorted(theirs))
    for key in theirs:
        assert ours[key].shape == theirs[key].shape and torch.equal(ours[key], theirs[key]), key
    # Every token trained: TRL's labels keep the image tokens, ours never train them.
    ours_all = collator([_examples(processor, records, chat_loss="all")[i] for i in rows])["labels"]
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    plain = DataCollatorForVisionLanguageModeling(processor=processor)
    theirs_all = plain(
        [{"messages": copy.deepcopy(records[i]["messages"]), "images": records[i]["images"]} for i in rows]
    )
    image = torch.isin(theirs["input_ids"], torch.tensor(sorted(image_token_ids(processor))))
    assert image.any() and bool((ours_all[image] == IGNORE_INDEX).all())
    assert torch.equal(ours_all[~image], theirs_all["labels"][~image])


def test_string_content_takes_its_images_before_the_first_user_text(processors: dict[str, Any]) -> None:
    processor = processors["qwen2_5_vl"]
    record = copy.deepcopy(vlm_records()[1])
    record["messages"][0]["content"] = "What colour is this?"
    record["messages"][1]["content"] = record["messages"][1]["content"][0]["text"]
    collator = vision_collator(
        processor, composite_config("qwen2_5_vl"), pad_token_id=0, packing=False, padding_free=False
    )
    ours = collator([_examples(processor, [record])[0]])
    theirs = trl_batch(processor, [record])
    assert torch.equal(ours["input_ids"], theirs["input_ids"]) and torch.equal(
        ours["labels"], theirs["labels"]
    )


def test_an_image_as_a_path_bytes_pil_or_the_image_column_gives_the_same_batch(
    processors: dict[str, Any], tmp_path: Any
) -> None:
    """TRL's image forms: a relative path (read from the data file's folder), PNG bytes, a PIL image (the ``datasets``
    Image feature's dict once in a Dataset) in an ``images`` list, or one image in an ``image`` column."""
    import io

    processor, record = processors["qwen2_5_vl"], vlm_records()[1]
    (image,) = record["images"]
    image.save(tmp_path / "a.png")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    messages = record["messages"]
    forms = {
        "pil": {"messages": messages, "images": [image]},
        "path": {"messages": messages, "images": ["a.png"]},
        "bytes": {"messages": messages, "images": [buffer.getvalue()]},
        "image column": {"messages": messages, "image": "a.png"},
    }
    collator = vision_collator(
        processor, composite_config("qwen2_5_vl"), pad_token_id=0, packing=False, padding_free=False
    )
    batches = {
        name: collator([_examples(processor, [form], image_root=tmp_path)[0]]) for name, form in forms.items()
    }
    want = trl_batch(processor, [record])
    for name, batch in batches.items():
        for key in want:
            assert torch.equal(batch[key], want[key]), (name, key)


def test_bad_image_records_are_refused_by_name(processors: dict[str, Any], tmp_path: Any) -> None:
    processor, records = processors["llava"], vlm_records()
    two = copy.deepcopy(records[0])
    two["images"] = two["images"][:1]  # two image parts, one image
    with pytest.raises(ValueError, match="2 image parts but the record has 1 images"):
        _examples(processor, [two])
    missing = {"messages": records[1]["messages"], "images": [str(tmp_path / "nowhere.png")]}
    with pytest.raises(ValueError, match="image file .*nowhere.png.* does not exist"):
        _examples(processor, [missing])
    skipped, stats = tokenize_dataset(
        datasets.Dataset.from_list([two, records[1]]), processor.tokenizer, max_length=512, processor=processor,
        on_bad_record="skip",
    )  # fmt: skip
    assert len(skipped) == 1 and stats.skipped == {"image count mismatch": 1}
    pairs = datasets.Dataset.from_list([{"prompt": "a", "completion": "b", "images": []}])
    with pytest.raises(ValueError, match="conversational 'messages' records only"):
        tokenize_dataset(pairs, processor.tokenizer, max_length=64, processor=processor)
    chats = datasets.Dataset.from_list([records[1]])
    with pytest.raises(ValueError, match="not a vision-language checkpoint"):
        tokenize_dataset(chats, processor.tokenizer, max_length=64)


def test_truncation_never_cuts_an_image(processors: dict[str, Any]) -> None:
    processor, records = processors["llava"], vlm_records()
    full = _examples(processor, [records[1]])[0]  # the image first, 16 tokens, then the text
    cut = full["length"] - 3
    kept, stats = tokenize_dataset(
        datasets.Dataset.from_list([records[1]]), processor.tokenizer, max_length=cut, processor=processor
    )
    assert stats.num_truncated == 1 and kept[0]["input_ids"] == full["input_ids"][:cut]
    collator = vision_collator(
        processor, composite_config("llava"), pad_token_id=0, packing=False, padding_free=False
    )
    assert torch.equal(collator([kept[0]])["input_ids"][0], torch.tensor(full["input_ids"][:cut]))
    with pytest.raises(ValueError, match="max_length=8; cutting it there would cut 11 image tokens"):
        tokenize_dataset(
            datasets.Dataset.from_list([records[1]]), processor.tokenizer, max_length=8, processor=processor
        )
    dropped, stats = tokenize_dataset(
        datasets.Dataset.from_list([records[1]]), processor.tokenizer, max_length=8, processor=processor,
        long_examples="drop",
    )  # fmt: skip
    assert len(dropped) == 0 and stats.num_dropped_long == 1


def test_gemma3_images_in_rows_of_several_documents_are_refused_by_name(processors: dict[str, Any]) -> None:
    with pytest.raises(
        ConfigError, match="padding_free=true with image records on Gemma3ForConditionalGeneration"
    ):
        vision_collator(
            processors["gemma3_vlm"], composite_config("gemma3_vlm"), pad_token_id=0, packing=False,
            padding_free=True,
        )  # fmt: skip


def test_the_tower_runs_in_every_forward_and_its_features_leave_the_output(
    processors: dict[str, Any],
) -> None:
    from transformers import AutoModelForImageTextToText

    from hf_fsdp2.vision.processor import dummy_image_inputs
    from hf_fsdp2.vision.tower import run_tower_always

    processor, config = processors["gemma3_vlm"], composite_config("gemma3_vlm")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    runs = []
    model.model.vision_tower.register_forward_pre_hook(lambda *_: runs.append(1))
    examples = _examples(processor, vlm_records())
    collator = vision_collator(processor, config, pad_token_id=0, packing=False, padding_free=False)
    text, images = collator([examples[2]]), collator([examples[0], examples[1]])
    inputs = {k: v for k, v in text.items() if k != "labels"}
    model(**inputs)
    assert not runs  # what a rank with a text-only micro-batch would skip: the tower's all-gather
    assert model(**{k: v for k, v in images.items() if k != "labels"}).image_outputs is not None
    hooks = run_tower_always(model, dummy_image_inputs(processor, model))
    runs.clear()
    out = model(**inputs)
    assert len(runs) == 1 and hooks.dummy_runs == 1
    out.logits.sum().backward()  # the dummy's zero gradient reaches the tower (its reduce-scatter runs)
    grads = [p.grad for p in model.model.vision_tower.parameters() if p.grad is not None]
    assert grads and all(not g.any() for g in grads)  # (SigLIP's pooling head, unused by Gemma 3, has none)
    assert model(**{k: v for k, v in images.items() if k != "labels"}).image_outputs is None
    assert len(runs) == 2 and hooks.dummy_runs == 1
    hooks.remove()
    model(**inputs)
    assert len(runs) == 2


def test_what_an_image_run_cannot_do_is_refused_by_name() -> None:
    import transformers

    from hf_fsdp2.config import parse_config
    from hf_fsdp2.config.plans import MeshPlan
    from hf_fsdp2.methods.sft.data import check_trained_parts
    from hf_fsdp2.run.registry import check_capabilities, get_method
    from hf_fsdp2.vision.families import image_training

    for family, processor in (
        ("mistral3", "PixtralProcessor"),
        ("llama4_vlm", "Llama4Processor"),
        ("qwen3_5_moe_vlm", "Qwen3VLProcessor"),
    ):
        with pytest.raises(ConfigError, match=f"image records on .*ForConditionalGeneration.*{processor}"):
            image_training(composite_config(family))
    with pytest.raises(ConfigError, match="LlamaForCausalLM is not a vision-language checkpoint"):
        image_training(transformers.LlamaConfig(architectures=["LlamaForCausalLM"]))
    assert image_training(composite_config("qwen3_5_vlm")).mrope
    assert image_training(composite_config("idefics3")).row_batched == (
        "pixel_values",
        "pixel_attention_mask",
    )
    # Training the tower needs image data: refused on text data, and by the methods that read no images.
    with pytest.raises(
        ConfigError, match="freeze_multi_modal_projector=false on LlavaForConditionalGeneration"
    ):
        check_trained_parts(
            composite_config("llava"), images=False, freeze_vision_tower=True, freeze_projector=False
        )
    check_trained_parts(
        composite_config("llava"), images=True, freeze_vision_tower=False, freeze_projector=False
    )
    cfg = parse_config(
        [
            "--model_name_or_path",
            "m",
            "--dataset_name",
            "d",
            "--output_dir",
            "o",
            "--freeze_vision_tower",
            "false",
        ]
    )
    with pytest.raises(ConfigError, match="freeze_vision_tower=false .* is not supported by the dpo recipe"):
        check_capabilities(get_method("dpo"), cfg, MeshPlan())
    check_capabilities(get_method("sft"), cfg, MeshPlan())


def test_the_vision_demo_builds_a_composite_that_reads_its_images(tmp_path: Any) -> None:
    """The demo's pieces on a tiny language model (the demo itself puts SmolLM2-135M there): the drawn records carry
    the answer their image shows, and the built composite tokenizes them through its own processor and is scored."""
    import json

    import numpy as np
    from support.tiny import make_tiny_llama_dir

    from hf_fsdp2.demo.vision import COLOURS, build_smolvlm, evaluate_vision_folder, write_vision_data

    written = write_vision_data(tmp_path / "data", n_train=4, n_eval=4, seed=0)
    records = [json.loads(line) for line in Path(written["eval"]).read_text().splitlines()]
    from PIL import Image

    first = records[0]  # the image's most common non-white pixel is the answer's colour
    pixels = [tuple(p) for p in np.asarray(Image.open(tmp_path / "data" / first["images"][0])).reshape(-1, 3)]
    shown = [p for p in pixels if p != (255, 255, 255)]
    assert max(set(shown), key=shown.count) == COLOURS[first["messages"][1]["content"][0]["text"]]
    folder = build_smolvlm(make_tiny_llama_dir(tmp_path / "text", tie_word_embeddings=True), tmp_path / "vlm")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    examples, stats = tokenize_dataset(
        datasets.load_dataset("json", data_files=written["train"], split="train"), processor.tokenizer,
        max_length=64, processor=processor, image_root=tmp_path / "data",
    )  # fmt: skip
    assert stats.num_kept == 4 and all(n >= 2 for n in examples["num_targets"])  # the word(s) and <|im_end|>
    scores = evaluate_vision_folder(folder, records, tmp_path / "data", batch_size=4)
    assert scores["n"] == 4 and 0 <= scores["exact_match"] <= 1 and 1 <= scores["distinct_answers"] <= 4


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5_vlm"])
def test_a_qwen_vl_folder_loads_without_torchvision_and_refuses_videos(
    processors: dict[str, Any], family: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hub-like folder (its video processor config included, which AutoProcessor cannot load without torchvision)
    gives the image processor + tokenizer + chat template, and the code-built processor's batches key by key."""
    from transformers.utils import is_torchvision_available

    from hf_fsdp2.vision.processor import load_processor

    built, records = processors[family], vlm_records()
    folder = save_vlm_processor(built, tmp_path / "ckpt")
    with caplog.at_level("INFO", logger="hf_fsdp2"):
        loaded = load_processor(str(folder))
    if not is_torchvision_available():
        assert loaded.video_processor is None and "videos are not available" in caplog.text
    assert type(loaded).__name__ == type(built).__name__
    collate = {
        name: vision_collator(
            p,
            composite_config(family),
            pad_token_id=p.tokenizer.pad_token_id,
            packing=False,
            padding_free=False,
        )
        for name, p in (("built", built), ("loaded", loaded))
    }
    want = collate["built"]([_examples(built, records)[i] for i in range(4)])
    got = collate["loaded"]([_examples(loaded, records)[i] for i in range(4)])
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    video = copy.deepcopy(records[2])
    video["messages"][0]["content"].append({"type": "video"})
    with pytest.raises(
        ValueError, match="message 0 has a video part: this version trains on images and text"
    ):
        _examples(loaded, [video])
    with pytest.raises(ValueError, match="the record has videos .column 'videos'."):
        _examples(loaded, [dict(records[1], videos=["clip.mp4"])])
