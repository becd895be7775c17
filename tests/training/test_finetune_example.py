"""examples/finetune_lora.py end to end: two gloo processes with mixed batches (item 13), the per-sample
loss the same over two processes, accumulation or one batch, and one process with packing and stages whose
saved adapter reloads."""

import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

import psutil
import pytest
import torch

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "finetune_lora.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "warning"}


def _run(command: list[str], timeout: int, attempts: int = 1) -> str:
    """Run with its output in a file, and on a hang kill every process it started. torchrun starts each
    worker in a session of its own, so neither killing torchrun's process group nor waiting for the end of
    a pipe (which the workers hold open) would stop a hung worker; CI then ran into its own time limit.
    Two-process runs get a second attempt: one CI run hung in gloo (20 reruns here did not), and a hang
    that comes back is still a failure."""
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryFile(mode="w+") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=ENV)
            try:
                process.wait(timeout=timeout)
                hung = False
            except subprocess.TimeoutExpired:
                _kill_tree(process.pid)
                hung = True
            log.seek(0)
            output = log.read()
        if not hung:
            assert process.returncode == 0, output[-5000:]
            return output
        message = f"no result after {timeout} s (a DDP hang?), attempt {attempt} of {attempts}:\n{output[-3000:]}"
        if attempt == attempts:
            pytest.fail(message)
        warnings.warn(message)


def _kill_tree(pid: int):
    root = psutil.Process(pid)
    tree = root.children(recursive=True) + [root]
    for member in tree:
        try:
            member.kill()
        except psutil.NoSuchProcess:  # it ended between the listing and the kill
            pass
    psutil.wait_procs(tree, timeout=30)


def test_a_hang_in_a_worker_of_its_own_session_fails_the_test_and_leaves_no_process(tmp_path):
    """What torchrun does with a hung worker: a child in a session of its own that keeps the output open."""
    pid_file = tmp_path / "worker.pid"
    worker = f"import os, time; open({str(pid_file)!r}, 'a').write(f'{{os.getpid()}} '); time.sleep(600)"
    launcher = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True)"
                ".wait()")
    with pytest.warns(UserWarning, match="attempt 1 of 2"), pytest.raises(pytest.fail.Exception,
                                                                          match="no result after 5 s.*attempt 2 of 2"):
        _run([sys.executable, "-c", launcher], timeout=5, attempts=2)
    pids = [int(pid) for pid in pid_file.read_text().split()]
    assert len(pids) == 2 and not any(psutil.pid_exists(pid) for pid in pids), pids


@pytest.mark.slow
def test_two_cpu_processes_with_text_only_and_image_batches_end_with_equal_weights(tmp_path):
    """One row per batch, rows 1, 2, 5, 6, ... without pixels: at every step one process has an image and
    the other none, and LoRA covers the vision tower and connector (DDP with find_unused_parameters=False)."""
    output = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", EXAMPLE,
                   "--output-dir", str(tmp_path), "--max-steps", "10", "--num-train", "20", "--scope", "all",
                   "--text-only", "alternate", "--batch-size", "1", "--no-progress"], timeout=240, attempts=2)
    checksums = dict(re.findall(r"rank (\d): trainable weights sha256 (\w+)", output))
    assert sorted(checksums) == ["0", "1"] and checksums["0"] == checksums["1"], output[-2000:]
    assert re.search(r"loss \d+\.\d+ -> \d+\.\d+ over 10 steps", output)
    assert (tmp_path / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sample", "answer"])
def test_a_per_sample_loss_is_one_batch_mean_over_two_processes_or_accumulated_micro_batches(tmp_path, loss):
    """Rows 0 and 1 (an image, then text only) as one batch of 2, as 2 accumulated micro-batches of 1, and
    as 1 row on each of two gloo processes: the same first-step loss. A plain Trainer logs (and trains on)
    twice it in both split cases: it takes a compute_loss_func's loss as scaled for accumulation, and
    multiplies it by the processes (average_tokens_across_devices); VLMKitTrainer does neither."""
    common = [EXAMPLE, "--max-steps", "1", "--num-train", "8", "--scope", "all", "--text-only", "alternate",
              "--no-progress", "--loss", loss]
    runs = {
        "one batch": [sys.executable, *common, "--batch-size", "2"],
        "accumulated": [sys.executable, *common, "--batch-size", "1", "--gradient-accumulation-steps", "2"],
        "two processes": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          *common, "--batch-size", "1"],
    }
    first_losses = {}
    for name, command in runs.items():
        output = _run(command + ["--output-dir", str(tmp_path / name.replace(" ", "-"))], timeout=240,
                      attempts=2 if name == "two processes" else 1)
        first_losses[name] = float(re.search(r"loss (\d+\.\d+) -> ", output).group(1))
    assert first_losses["one batch"] > 1.0
    assert first_losses["accumulated"] == pytest.approx(first_losses["one batch"], abs=2e-4), first_losses
    assert first_losses["two processes"] == pytest.approx(first_losses["one batch"], abs=2e-4), first_losses


@pytest.mark.slow
def test_one_process_with_packing_and_stages_saves_an_adapter_that_reloads(tmp_path):
    output = _run([sys.executable, EXAMPLE, "--output-dir", str(tmp_path), "--max-steps", "6", "--num-train", "12",
                   "--scope", "llm", "--stages", "0:connector;3:connector,llm", "--packing", "--batch-size", "3",
                   "--no-progress"], timeout=180)
    assert "over 6 steps" in output
    from peft import PeftModel

    import vlmkit
    from vlmkit.data import as_messages, build_dataset
    from vlmkit.training import VLMKitDataCollator

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["modules_to_save"][0] == "model.visual.merger"  # the connector trained in full is saved
    base = vlmkit.VLMKitForConditionalGeneration.from_pretrained(tmp_path / "base_model").eval()
    processor = vlmkit.VLMKitProcessor.from_pretrained(tmp_path)
    rows = build_dataset(2, 0, 0, seed=0, image_size=64, num_frames=4, tasks=["count"])["train"]
    batch = VLMKitDataCollator(processor)([as_messages(row) for row in rows])
    with torch.no_grad():
        before = base(**batch).logits
        adapted = PeftModel.from_pretrained(base, tmp_path).eval()(**batch).logits
    assert (adapted - before).abs().max() > 1e-4  # the adapter and the connector weights load and act
