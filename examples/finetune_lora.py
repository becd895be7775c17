"""Fine-tune a vlmkit model with Trainer and LoRA on a `datasets` dataset.

    # a tiny random model on ShapesWorld samples drawn here (no download), LoRA on the LLM
    python examples/finetune_lora.py --output-dir /tmp/lora-run

    # a saved model and dataset; LoRA on LLM and vision tower; connector alone for 50 steps, then with the LLM
    python examples/finetune_lora.py --model path/to/vlmkit-model --dataset path/to/saved-dataset \\
        --scope llm,vision --stages "0:connector;50:connector,llm,vision" --packing --output-dir runs/lora

    # two CPU processes (gloo); `accelerate launch --num_processes 2 ...` works the same way
    torchrun --nproc_per_node 2 examples/finetune_lora.py --scope all --text-only alternate --max-steps 10

Rows are chat messages (a "messages" column, images and videos inline or TRL-style in "images" /
"videos" columns) or ShapesWorld rows (`vlmkit.data.build_dataset`), which become messages through
`vlmkit.data.as_messages`. Labels learn only the assistant turns (`vlmkit.training.VLMKitDataCollator`).
`--scope` picks the LoRA targets (`vlmkit.training.lora_target_modules`); `--stages` switches the trained
components during the run (`StagedTrainingCallback`); a stage that trains the connector without LoRA on
it trains it in full and saves it with the adapter (peft `modules_to_save`). `--packing` puts each batch
in one row without padding. `--loss sample` (or `answer`) weighs samples (or assistant turns) equally
instead of tokens, through `VLMKitTrainer`, which keeps that loss right under gradient accumulation and
over several processes. The adapter (and the processor) are saved to `--output-dir`; a tiny model's
base weights go to `--output-dir/base_model` so the adapter can be loaded again.

Every process prints a checksum of its trainable weights at the end: under DDP they must be equal.
"""

import argparse
import hashlib
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import TrainingArguments

import vlmkit
from vlmkit.data import as_messages, build_dataset
from vlmkit.training import (
    COMPONENTS,
    LOSS_FUNCTIONS,
    StagedTrainingCallback,
    VLMKitDataCollator,
    VLMKitTrainer,
    connector_module_names,
    lora_target_modules,
)


def parse_stages(text: str | None) -> list[tuple[int, list[str]]] | None:
    """"0:connector;50:connector,llm" -> [(0, ["connector"]), (50, ["connector", "llm"])]."""
    if not text:
        return None
    stages = []
    for part in text.split(";"):
        step, _, components = part.partition(":")
        stages.append((int(step), [c.strip() for c in components.split(",") if c.strip()]))
    return stages


def tiny_model_and_processor(texts: list[str]):
    """A small random vlmkit model (patch 16, merge 2) and a BPE tokenizer trained on the dataset's texts."""
    tokenizer = vlmkit.build_tokenizer(texts + [f"<{t / 10:.1f} seconds>" for t in range(100)], vocab_size=400)
    ids = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    config = vlmkit.VLMKitConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        image_token_id=ids[0], video_token_id=ids[1], vision_start_token_id=ids[2], vision_end_token_id=ids[3],
    )
    model = vlmkit.VLMKitForConditionalGeneration(config)
    image_processor = vlmkit.VLMKitImageProcessor(patch_size=16, merge_size=2, size={"shortest_edge": 32 * 32,
                                                                                   "longest_edge": 128 * 128})
    video_processor = vlmkit.VLMKitVideoProcessor(patch_size=16, merge_size=2, size={"shortest_edge": 32 * 32,
                                                                                   "longest_edge": 8 * 128 * 128})
    processor = vlmkit.VLMKitProcessor.for_model(config, tokenizer, image_processor=image_processor,
                                                 video_processor=video_processor)
    return model, processor


class ChatRows:
    """Dataset rows -> collator rows: "messages" rows pass through; ShapesWorld rows become messages.
    With `text_only_pattern`, rows 1, 2, 5, 6, 9, ... lose their image (or video), so with two processes
    and one row per batch each process alternates image and text-only batches, and at every step one
    of them has no pixels."""

    def __init__(self, dataset, text_only_pattern: bool = False):
        self.dataset = dataset
        self.text_only_pattern = text_only_pattern

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        row = self.dataset[index]
        if "messages" in row:
            return row
        if self.text_only_pattern and (index // 2 + index) % 2 == 1:
            row = {**row, "image": None, "video": None}
        return {"messages": as_messages(row), "fps": row.get("fps")}


def load_data(args):
    if args.dataset:
        from datasets import DatasetDict, load_from_disk

        data = load_from_disk(args.dataset)
        return data["train"] if isinstance(data, DatasetDict) else data
    # 64 px images: 4 x 4 patches of 16, 4 visual tokens each
    return build_dataset(args.num_train, 0, 0, seed=args.seed, image_size=64, num_frames=4)["train"]


def weights_checksum(model) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        if param.requires_grad:
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a saved vlmkit or Qwen3-VL model and processor (default: a tiny random one)")
    parser.add_argument("--dataset", help="datasets.load_from_disk folder (default: ShapesWorld samples drawn here)")
    parser.add_argument("--num-train", type=int, default=64, help="ShapesWorld samples when no --dataset is given")
    parser.add_argument("--output-dir", default="finetune-lora-output")
    parser.add_argument("--scope", default="llm", help="LoRA scope(s): llm, vision, connector, all, or a comma list")
    parser.add_argument("--stages", help='trained components by step, e.g. "0:connector;50:connector,llm"')
    parser.add_argument("--packing", action="store_true", help="padding-free: each batch in one row")
    parser.add_argument("--max-length", type=int, help="longest sample in tokens")
    parser.add_argument("--overflow", choices=("raise", "drop"), default="raise", help="what to do with longer samples")
    parser.add_argument("--text-only", choices=("none", "alternate"), default="none",
                        help="alternate: drop the pixels of rows 1, 2, 5, 6, ... (sequential order)")
    parser.add_argument("--loss", choices=tuple(LOSS_FUNCTIONS), default="token",
                        help="weigh every answer token equally (the model's loss), every sample (per_sample_loss) "
                             "or every assistant turn (per_answer_loss)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=2, help="per process")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--activation-checkpointing", choices=("off", "reentrant", "non-reentrant"), default="off")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)  # same base model and adapter on every process
    dataset = load_data(args)
    if args.model:
        model = vlmkit.VLMKitForConditionalGeneration.from_pretrained(args.model)
        processor = vlmkit.VLMKitProcessor.from_pretrained(args.model)
    else:
        texts = [t for row in dataset for t in (row.get("question"), row.get("answer")) if t]
        model, processor = tiny_model_and_processor(texts)
        if int(os.environ.get("RANK", "0")) == 0:
            model.save_pretrained(os.path.join(args.output_dir, "base_model"))
            processor.save_pretrained(os.path.join(args.output_dir, "base_model"))
    model.config.use_cache = False

    scopes = [s.strip() for s in args.scope.split(",")]
    covered = set(COMPONENTS) if "all" in scopes else set(scopes)
    stages = parse_stages(args.stages)
    staged = {c for _, components in stages for c in components} if stages else set()
    if staged - covered - {"connector"}:
        uncovered = sorted(staged - covered - {"connector"})
        parser.error(f"--stages trains {uncovered} without LoRA on it; add it to --scope")
    full_connector = "connector" in staged and "connector" not in covered
    lora = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=lora_target_modules(model, scopes),
        modules_to_save=connector_module_names(model) if full_connector else None, task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    model.print_trainable_parameters()

    checkpointing = args.activation_checkpointing != "off"
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size, max_steps=args.max_steps,
        gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
        logging_steps=max(1, args.max_steps // 20), save_strategy="no", report_to=[], seed=args.seed,
        remove_unused_columns=False, use_cpu=not torch.cuda.is_available(), disable_tqdm=args.no_progress,
        activation_checkpointing=checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": args.activation_checkpointing == "reentrant"},
        train_sampling_strategy="sequential" if args.text_only == "alternate" else "random",
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available() else None,
        # every parameter is used at every step, pixels or not (vlmkit's dummy visual pass); only stages leave
        # some without a gradient
        ddp_find_unused_parameters=bool(stages),
    )
    collator = VLMKitDataCollator(processor, max_length=args.max_length, packing=args.packing, overflow=args.overflow)
    trainer = VLMKitTrainer(
        model=model, args=training_args, train_dataset=ChatRows(dataset, args.text_only == "alternate"),
        data_collator=collator, callbacks=[StagedTrainingCallback(stages)] if stages else None,
        compute_loss_func=LOSS_FUNCTIONS[args.loss],
    )
    result = trainer.train()
    trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        processor.save_pretrained(args.output_dir)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {result.global_step} steps; adapter in {args.output_dir}")
    rank = int(os.environ.get("RANK", "0"))
    print(f"rank {rank}: trainable weights sha256 {weights_checksum(model)}", flush=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # leave together: a rank that exits while another is still saving can abort gloo's teardown
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
