"""The model and data sections of a recipe: one dataclass each, every field with a default and a help line,
each validating itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_fsdp2.config.plans import (
    PACKED_ATTENTION_IMPLEMENTATIONS,
    ConfigError,
    check,
)
from hf_fsdp2.config.sources import DataSource, parse_column_mapping, parse_source, resolve_sources


@dataclass(kw_only=True)
class ModelArgs:
    """Which model and tokenizer to load, and how."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub model id or local folder of an HF causal LM (required)."}
    )
    model_revision: str | None = field(
        default=None, metadata={"help": "Hub revision (branch, tag or commit)."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer id or folder; defaults to model_name_or_path."}
    )
    torch_dtype: Literal["float32", "bfloat16", "float16", "auto"] = field(
        default="float32",
        metadata={
            "help": "dtype the weights are loaded in. FSDP2 keeps fp32 master copies of trainable "
            "parameters under mixed precision whatever this is."
        },
    )
    attn_implementation: str = field(
        default="auto",
        metadata={
            "help": "Attention kernel: auto (transformers picks what the model supports: sdpa, else eager), sdpa, "
            "eager, flash_attention_2/3 (needs flash-attn or kernels), flex_attention. On a GPU padding-free "
            "batches need flex_attention or flash_attention_2/3 (sdpa/eager would build a dense [T x T] mask)."
        },
    )
    resize_token_embeddings: bool = field(
        default=False,
        metadata={
            "help": "Grow the model's embedding (and untied head) to the tokenizer's size when the tokenizer has "
            "more tokens than the model has rows; off: such a pair is refused."
        },
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run model code from the hub repo; off unless you trust it."}
    )
    freeze_vision_tower: bool = field(
        default=True,
        metadata={
            "help": "A composite checkpoint (vision tower + projector + language model): keep the vision tower frozen "
            "(no gradient or optimizer state; one FSDP2 unit, never gathered on text rows; exported as loaded). "
            "false is refused on text data, where the tower never runs. No effect on a text model."
        },
    )
    freeze_multi_modal_projector: bool = field(
        default=True,
        metadata={
            "help": "A composite checkpoint: keep the multi-modal projector frozen, as freeze_vision_tower keeps the "
            "tower. false is refused on text data. No effect on a text model."
        },
    )

    def validate(self) -> None:
        """Raises ConfigError for a value argparse cannot refuse."""
        check(
            self.model_name_or_path is not None,
            "model_name_or_path is required: a hub id or a local model folder",
        )


@dataclass(kw_only=True)
class DataArgs:
    """Where the training records come from and how they become token ids and loss masks."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset id, local .jsonl/.json/.parquet/.csv/.txt/.arrow file, or folder "
            "(required unless dataset_mixture is given)."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset subset."})
    dataset_split: str = field(default="train", metadata={"help": "Split of a hub dataset to train on."})
    dataset_revision: str | None = field(
        default=None, metadata={"help": "Hub dataset branch, tag or commit."}
    )
    dataset_mixture: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Weighted sources instead of dataset_name: 'id_or_path[?subset=S&split=T&revision=R]:weight,...'; "
            "weight 0.5 takes a seeded half of a source's records, 2 every record twice."
        },
    )
    dataset_format: Literal["auto", "messages", "conversations", "prompt_completion", "alpaca", "text"] = (
        field(
            default="auto",
            metadata={"help": "Record format; auto detects it from the columns of each source."},
        )
    )
    dataset_column_mapping: list[str] = field(
        default_factory=list,
        metadata={"help": "Rename columns before format detection: 'question=prompt,answer=completion'."},
    )
    dataset_tools: str | None = field(
        default=None,
        metadata={
            "help": "Tool schemas the chat template receives for every chat record without its own 'tools': a JSON "
            "list, or the path of a .json file holding one (docs/sft.md, tool-calling data)."
        },
    )
    dataset_num_proc: int | None = field(
        default=None,
        metadata={"help": "Processes that tokenize (datasets.map num_proc); the result is cached."},
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={"help": "Eval source: hub id or local path, optionally 'id?subset=S&split=T'."},
    )
    eval_dataset_split: str = field(default="test", metadata={"help": "Split of eval_dataset_name."})
    eval_split_fraction: float = field(
        default=0.0,
        metadata={"help": "Hold out this fraction of every training source for eval (seeded); 0 = none."},
    )
    max_length: int = field(default=1024, metadata={"help": "Tokens per example (and per packed row)."})
    long_examples: Literal["truncate", "drop", "error"] = field(
        default="truncate",
        metadata={
            "help": "Examples longer than max_length: truncate, drop (counted), or error (a bad record)."
        },
    )
    on_bad_record: Literal["error", "skip"] = field(
        default="error",
        metadata={
            "help": "Malformed records: error (names source and index) or skip (counted in the summary)."
        },
    )
    chat_loss: Literal["assistant", "last_assistant", "all"] | None = field(
        default=None,
        metadata={
            "help": "Chat records: loss on every assistant turn, the last one only, or every token; "
            "unset follows assistant_only_loss."
        },
    )
    assistant_only_loss: bool = field(
        default=True,
        metadata={"help": "Chat records: loss on assistant tokens only (false = chat_loss all)."},
    )
    completion_only_loss: bool = field(
        default=True, metadata={"help": "prompt/completion records: loss on the completion only."}
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Pack several examples per row of max_length (best-fit decreasing); position_ids restart "
            "per example and no attention crosses examples (under flash_attention_2/3 a micro-batch's rows are "
            "flattened into one row: transformers' flash path separates examples only in a one-row batch)."
        },
    )
    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Flatten each micro-batch into one row without padding (position_ids mark examples): no work "
            "on padding. Unset (SFT): on a GPU, on with flex_attention or flash_attention_2/3 and off with "
            "sdpa/eager (they would build a dense [T x T] mask over the row); on CPU, on when a probe forward "
            "shows padded and padding-free batches give the same logits. Logged at start. true with sdpa/eager "
            "on a GPU is allowed but warned; rows of several documents under flash_attention_2/3 are always "
            "padding-free (false is refused there)."
        },
    )
    dataloader_num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes."})
    text_unit: Literal["paragraph", "document", "line"] = field(
        default="paragraph",
        metadata={
            "help": "What one record of a .txt file is: a paragraph (blank-line separated), the whole file, "
            "or a line."
        },
    )
    corpus_layout: Literal["concat", "best_fit"] = field(
        default="concat",
        metadata={
            "help": "Continued pre-training rows: concat (documents end to end, rows exactly max_length, a cut "
            "document continues in the next row) or best_fit (documents cut to max_length, packed by best fit)."
        },
    )
    cross_document_attention: bool = field(
        default=False,
        metadata={
            "help": "Continued pre-training: let documents in one row attend to each other (one sequence per "
            "row); false restarts positions per document, as packing does."
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Continued pre-training: stream the corpus (datasets iterable), tokenized on the fly, each "
            "rank its own slice; needs max_steps. The position is saved in checkpoints."
        },
    )
    text_column: str = field(
        default="text", metadata={"help": "Continued pre-training: the column with the text."}
    )

    def resolved_chat_loss(self) -> str:
        """``chat_loss``, or what ``assistant_only_loss`` means when it is unset."""
        return self.chat_loss or ("assistant" if self.assistant_only_loss else "all")

    def sources(self) -> list[DataSource]:
        """The training sources: ``dataset_name``, or the weighted ``dataset_mixture``."""
        return resolve_sources(
            dataset_name=self.dataset_name,
            dataset_config_name=self.dataset_config_name,
            dataset_split=self.dataset_split,
            dataset_revision=self.dataset_revision,
            dataset_mixture=self.dataset_mixture,
        )

    def eval_source(self) -> DataSource | None:
        """The separate eval source, if one is given."""
        if self.eval_dataset_name is None:
            return None
        return parse_source(self.eval_dataset_name, split=self.eval_dataset_split)

    def has_eval(self) -> bool:
        return self.eval_dataset_name is not None or self.eval_split_fraction > 0

    def validate(self, attn_implementation: str) -> None:
        """Raises ConfigError for a value argparse cannot refuse (sources are parsed, not read)."""
        check(
            self.dataset_name is not None or bool(self.dataset_mixture),
            "dataset_name is required: a hub dataset id, a local file or folder (or give dataset_mixture)",
        )
        check(self.max_length > 0, f"max_length={self.max_length} must be > 0")
        check(
            self.dataloader_num_workers >= 0,
            f"dataloader_num_workers={self.dataloader_num_workers} must be >= 0",
        )
        try:
            self.sources()
            parse_column_mapping(self.dataset_column_mapping)
            self.eval_source()
        except ValueError as err:
            raise ConfigError(str(err)) from err
        check(
            self.eval_dataset_name is None or self.eval_split_fraction == 0,
            f"eval_dataset_name={self.eval_dataset_name!r} and eval_split_fraction={self.eval_split_fraction}: give "
            "one eval source, a separate dataset or a fraction held out from train",
        )
        check(
            0 <= self.eval_split_fraction < 1,
            f"eval_split_fraction={self.eval_split_fraction} must be in [0, 1)",
        )
        check(
            self.dataset_num_proc is None or self.dataset_num_proc >= 1,
            f"dataset_num_proc={self.dataset_num_proc} must be >= 1 (or unset: tokenize in the main process)",
        )
        check(
            self.assistant_only_loss or self.chat_loss in (None, "all"),
            f"chat_loss={self.chat_loss!r} trains on assistant turns but assistant_only_loss=false asks for every "
            "token; unset one of them",
        )
        check(
            not (self.cross_document_attention and self.corpus_layout == "best_fit"),
            "cross_document_attention=true needs corpus_layout=concat (best_fit packs pieces of documents apart)",
        )
        check(
            not (self.streaming and self.corpus_layout == "best_fit"),
            "streaming=true needs corpus_layout=concat (best_fit needs every document's length up front)",
        )
        if (self.packing or self.padding_free) and attn_implementation != "auto":  # auto: checked once loaded
            check(
                attn_implementation in PACKED_ATTENTION_IMPLEMENTATIONS,
                f"packing={self.packing}, padding_free={self.padding_free} need an attention implementation that "
                f"keeps examples apart by position_ids, one of {list(PACKED_ATTENTION_IMPLEMENTATIONS)}; "
                f"attn_implementation={attn_implementation!r} is not; use sdpa or turn packing off",
            )
