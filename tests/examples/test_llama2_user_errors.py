"""The Llama 2 examples' user mistakes are one-line usage errors raised before anything is loaded (no training run).

Each test calls a script's `main` (or the shared checks) in this process: the checks run before
the process group starts, so a mistake must raise `UsageError` without touching the model,
the data or a process group, and a resume that has nothing to train must write nothing.
"""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "llama2"
sys.path.insert(0, str(EXAMPLES))

import bayes_opt_sg_llama2  # noqa: E402
import ds_3d_llama2  # noqa: E402
import example_utils as eu  # noqa: E402
import fsdp_llama2  # noqa: E402

from atorch.checkpoint import manifest as mf  # noqa: E402


def fake_checkpoint(directory: Path, step: int, strategy=("parallel_mode", "fsdp"), peft_adapter=None) -> Path:
    """A directory with the manifest and meta.json `locate_resume` reads (no tensors: nothing loads them)."""
    directory.mkdir(parents=True)
    (directory / mf.MANIFEST_NAME).write_text(mf.Manifest(files={}, step=step).to_json())
    meta = {"format": mf.FORMAT_NAME, "version": mf.FORMAT_VERSION, "step": step, "strategy": list(strategy),
            "model": {"peft_adapter": peft_adapter, "tp_lora": None}}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def parse(module, tmp_path, *argv):
    return module.build_parser().parse_args(["--output_dir", str(tmp_path / "out"), *argv])


@pytest.mark.parametrize("module", [fsdp_llama2, ds_3d_llama2, bayes_opt_sg_llama2])
def test_resume_with_max_steps_below_the_checkpoint_is_refused(tmp_path, module):
    ckpt = fake_checkpoint(tmp_path / "out" / "checkpoints" / "step_6", step=6)
    (ckpt.parent / mf.LATEST_NAME).write_text("step_6\n")
    for resume in ([str(ckpt)], []):   # an explicit checkpoint, and RESUME=1 (the latest in OUTPUT_DIR)
        args = parse(module, tmp_path, "--max_steps", "2", "--resume", *resume)
        with pytest.raises(eu.UsageError, match=r"MAX_STEPS \(--max_steps\)=2 is below the step 6 of the checkpoint "
                                                r".*step_6.*give MAX_STEPS > 6"):
            module.main(args)


@pytest.mark.parametrize("module", [fsdp_llama2, ds_3d_llama2, bayes_opt_sg_llama2])
def test_resume_at_max_steps_trains_and_writes_nothing(tmp_path, module, capsys):
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "step_6", step=6)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    module.main(parse(module, tmp_path, "--max_steps", "6", "--resume", str(ckpt)))   # returns before any load
    assert "at step 6 = MAX_STEPS (--max_steps): nothing to train, no checkpoint written" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_resume_point_and_the_label_of_every_save(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "step_6", step=6)
    args = parse(fsdp_llama2, tmp_path, "--max_steps", "8", "--resume", str(ckpt))
    point = eu.locate_resume(args)
    assert point == eu.ResumePoint(str(ckpt), 6, lora_enabled=False) and not eu.nothing_to_train(args, point)
    # A checkpoint is labelled with the step its state is at, never with another (e.g. MAX_STEPS).
    checkpointer = eu.Checkpointer(args, result=None, resume_from=point)
    checkpointer.state_step = 6
    with pytest.raises(RuntimeError, match=r"save\(step=8\) but the training state is at step 6"):
        checkpointer.save(8)


def test_resume_from_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    args = parse(fsdp_llama2, tmp_path, "--resume", str(tmp_path / "data"))
    with pytest.raises(eu.UsageError, match=r"RESUME \(--resume\)='.*data': .*not a checkpoint \(no manifest.json"):
        fsdp_llama2.main(args)
    args = parse(fsdp_llama2, tmp_path, "--resume", str(tmp_path / "nothing_here"))
    with pytest.raises(eu.UsageError, match="RESUME .*no such checkpoint directory"):
        fsdp_llama2.main(args)


def test_resume_of_a_lora_checkpoint_without_use_lora(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "step_2", step=2, strategy=("parallel_mode", "lora", "fsdp"),
                           peft_adapter="default")
    with pytest.raises(eu.UsageError, match=r"trained with LoRA adapters but USE_LORA \(--use_lora\) is off; "
                                            "resume with USE_LORA=1"):
        fsdp_llama2.main(parse(fsdp_llama2, tmp_path, "--max_steps", "4", "--resume", str(ckpt)))
    args = parse(fsdp_llama2, tmp_path, "--max_steps", "4", "--resume", str(ckpt), "--use_lora")
    assert eu.locate_resume(args).lora_enabled


def test_resume_of_a_plain_checkpoint_with_use_lora(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "step_2", step=2)
    with pytest.raises(eu.UsageError, match=r"trained without LoRA but USE_LORA \(--use_lora\) is on; .*resume with "
                                            r"USE_LORA=0, or .*`atorch merge`"):
        fsdp_llama2.main(parse(fsdp_llama2, tmp_path, "--max_steps", "4", "--resume", str(ckpt), "--use_lora"))


@pytest.mark.parametrize("argv, message", [
    (["--log_with", "foo"], r"LOG_WITH \(--log_with\)='foo': valid values are tensorboard, jsonl or none"),
    (["--learning_rate", "-1"], r"LEARNING_RATE \(--learning_rate\)=-1.0 must be > 0"),
    (["--learning_rate", "nan"], r"LEARNING_RATE \(--learning_rate\)=nan must be > 0"),
    (["--peak_tflops", "0"], r"PEAK_TFLOPS \(--peak_tflops\)=0.0 must be > 0"),
    (["--model_name_or_path", "llama2-7b"], r"MODEL_NAME_OR_PATH \(--model_name_or_path\)='llama2-7b' does not "
                                            r"exist: 'llama2-7b' is a size preset of `atorch plan`, not a model"),
    (["--model_name_or_path", "meta-llama/Llama-2-7b-hf"], "load local files only .no hub downloads.; it must be a "
                                                            "local model folder"),
    (["--config_name", "llama2-7b"], r"CONFIG_NAME \(--config_name\)='llama2-7b' does not exist"),
])
def test_value_mistakes_name_the_variable(tmp_path, argv, message):
    with pytest.raises(eu.UsageError, match=message):
        fsdp_llama2.main(parse(fsdp_llama2, tmp_path, *argv))


def test_valid_log_with_values_pass(tmp_path):
    for value in ("none", "jsonl", "tensorboard,jsonl"):
        eu.validate_common_args(parse(fsdp_llama2, tmp_path, "--log_with", value))


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(eu.UsageError, match=r"OUTPUT_DIR \(--output_dir\)='.*out' is an existing file"):
        fsdp_llama2.main(parse(fsdp_llama2, tmp_path))


def test_config_folder_without_a_tokenizer_names_tokenizer_name(tmp_path):
    from atorch.testing import tiny_llama_config
    from atorch.testing.assets import load_tokenizer

    config_dir = tmp_path / "config"
    tiny_llama_config().save_pretrained(config_dir)
    with pytest.raises(eu.UsageError, match=r"the CONFIG_NAME folder '.*config' has no tokenizer .*set TOKENIZER_NAME "
                                            r"\(--tokenizer_name\)"):
        fsdp_llama2.main(parse(fsdp_llama2, tmp_path, "--config_name", str(config_dir)))
    with pytest.raises(eu.UsageError, match="the CONFIG_NAME folder .* has no tokenizer"):
        fsdp_llama2.main(parse(fsdp_llama2, tmp_path, "--config_name", str(config_dir / "config.json")))
    with pytest.raises(eu.UsageError, match=r"TOKENIZER_NAME \(--tokenizer_name\)='.*config' is not a local folder "
                                            "with a tokenizer"):
        eu.validate_common_args(parse(fsdp_llama2, tmp_path, "--config_name", str(config_dir), "--tokenizer_name",
                                      str(config_dir)))
    load_tokenizer().save_pretrained(tmp_path / "tok")
    eu.validate_common_args(parse(fsdp_llama2, tmp_path, "--config_name", str(config_dir), "--tokenizer_name",
                                  str(tmp_path / "tok")))


@pytest.mark.parametrize("env, message", [
    ({"BO_SG_MAX_IETR": "0"}, "BO_SG_MAX_IETR=0 must be >= 1"),
    ({"BO_SG_MAX_IETR": "abc"}, "BO_SG_MAX_IETR='abc' must be an integer"),
    ({"RANDOM_SAMPLE": "-1"}, "RANDOM_SAMPLE=-1 must be >= 0"),
])
def test_search_variables_are_checked_before_the_model_loads(tmp_path, monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(eu.UsageError, match=message):
        bayes_opt_sg_llama2.main(parse(bayes_opt_sg_llama2, tmp_path))


@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("blank.txt", "\n\n"),
                                           ("notext.jsonl", '{"content": "a"}\n{"content": "b"}\n')])
def test_a_corpus_without_a_usable_document_is_a_usage_error(tmp_path, name, content):
    """Raised by every rank before the one-rank-per-node build (whose failure the others only hear of)."""
    from atorch.testing.assets import load_tokenizer

    corpus = tmp_path / name
    corpus.write_text(content)
    args = parse(fsdp_llama2, tmp_path, "--dataset_path", str(corpus))
    with pytest.raises(eu.UsageError, match=r"DATASET_PATH \(--dataset_path\) '.*' has no usable document"):
        eu.tokenized_corpus(args, load_tokenizer())
    assert not list((tmp_path / "out" / "data_cache").glob("*.bin"))


def test_a_resumed_schedule_follows_the_new_max_steps(tmp_path):
    """Run 1: MAX_STEPS=4. Run 2 resumes at 4 with MAX_STEPS=8: the restored lambda had the horizon 4
    (the LR at its floor); it now decays over 8 steps, as an 8-step run from the start would."""
    import torch

    def scheduler(total):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, eu.WarmupCosine(1, total))

    first = scheduler(4)
    for _ in range(4):
        first.optimizer.step()
        first.step()
    resumed, reference = scheduler(8), scheduler(8)
    resumed.load_state_dict(first.state_dict())
    assert resumed.lr_lambdas[0].total == 4   # what the checkpoint restores
    args = parse(fsdp_llama2, tmp_path, "--max_steps", "8", "--warmup_steps", "1")
    assert eu.follow_schedule(resumed, args) == "the learning-rate schedule is extended from 4 to MAX_STEPS=8 steps"
    for _ in range(4):
        reference.optimizer.step()
        reference.step()
    for _ in range(4):   # steps 5..8 at the 8-step curve's rates
        assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(reference.optimizer.param_groups[0]["lr"])
        for s in (resumed, reference):
            s.optimizer.step()
            s.step()
    assert eu.follow_schedule(None, args) is None


def test_a_resume_with_a_smaller_max_steps_keeps_the_planned_schedule(tmp_path):
    """Stopping a 20-step plan at step 13 trains steps 11-13 exactly as the uninterrupted run did."""
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, eu.WarmupCosine(0, 20))
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    lr = optimizer.param_groups[0]["lr"]
    args = parse(fsdp_llama2, tmp_path, "--max_steps", "13")
    assert "keeps its horizon of 20 steps" in eu.follow_schedule(scheduler, args)
    assert scheduler.lr_lambdas[0].total == 20 and optimizer.param_groups[0]["lr"] == lr


@pytest.mark.parametrize("name", ["model_parallel_size", "pipeline_parallel_size"])
def test_ds_3d_parallel_sizes_below_one(tmp_path, name):
    """MODEL_PARALLEL_SIZE=0 was 'world size 2 is not divisible by MODEL_PARALLEL_SIZE=0 x ...'."""
    with pytest.raises(eu.UsageError, match=rf"{name.upper()} \(--{name}\)=0 must be >= 1"):
        ds_3d_llama2.main(parse(ds_3d_llama2, tmp_path, f"--{name}", "0"))


def test_resume_at_a_global_batch_that_cannot_continue_the_epoch(tmp_path, monkeypatch):
    """A ValueError from deep inside load_checkpoint (a traceback, exit 1) before; now the usage one-liner,
    before anything is loaded."""
    from types import SimpleNamespace

    import atorch.checkpoint

    monkeypatch.setattr(atorch.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("loaded the checkpoint"))
    # Saved 2 global batches of 4 into epoch 1 (8 samples): a global batch of 3 would repeat or skip samples.
    point = eu.ResumePoint(str(tmp_path / "step_10"), 10, False, {"epoch": 1, "batches_in_epoch": 2,
                                                                  "global_batch_size": 4})
    result = SimpleNamespace(dataloader=SimpleNamespace(batch_size=3), args={"data_parallel_size": 1})
    checkpointer = eu.Checkpointer(parse(fsdp_llama2, tmp_path, "--max_steps", "14"), result, resume_from=point)
    with pytest.raises(eu.UsageError, match=r"RESUME \(--resume\)='.*step_10': the checkpoint stopped 2 global batches "
                                            r"of 4 samples \(8 samples\) into epoch 1, which is not a whole number"):
        checkpointer.resume()
    result.dataloader.batch_size, result.args["data_parallel_size"] = 1, 2   # 8 samples = 4 batches of 2
    with pytest.raises(pytest.fail.Exception, match="loaded the checkpoint"):
        checkpointer.resume()
    # The position travels from meta.json to the resume point.
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "step_6", step=6)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "data_position": point.data_position}))
    assert eu.locate_resume(parse(fsdp_llama2, tmp_path, "--resume", str(ckpt))).data_position == point.data_position
