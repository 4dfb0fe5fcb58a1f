"""Every way a user can get the flags, the model or the data wrong ends in
one line naming the problem and the fix, before anything heavy happens."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from conftest import SAMPLE, mlx_lm_class_patches_undone

from mlx_pager.cli import lora_main


def lora(capsys, *flags):
    """Runs `mlx-pager lora` in-process; returns (exit code, stderr)."""
    rc = lora_main([str(f) for f in flags])
    return rc, capsys.readouterr().err


@pytest.fixture
def model(models):
    return models("llama", 4)


def base(model, tmp_path, data=SAMPLE):
    return [
        "--model",
        model,
        "--train",
        "--data",
        data,
        "--iters",
        1,
        "--num-layers",
        2,
        "--adapter-path",
        tmp_path / "a",
        "--ssd-cache-dir",
        tmp_path / "c",
        "--memory-budget",
        "2GB",
    ]


def one_line(err: str) -> str:
    lines = [l for l in err.strip().splitlines() if not l.startswith("mlx-pager: warning")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "records, expected",
    [
        ([], "has no records"),
        ([{"txt": "hello"}], "mlx-lm's formats are"),
        ([{"text": "a"}] * 4 + ["BROKEN"] + [{"text": "b"}], "train.jsonl line 5 is not valid JSON"),
        ([{"text": "a"}, {"prompt": "p"}], "line 2 lacks ['text']"),
        ([{"text": "a"}] * 5 + [" "] + [{"text": "b"}], "train.jsonl line 6 is blank"),
    ],
)
def test_bad_data_files(capsys, model, tmp_path, records, expected):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    rc, err = lora(capsys, *base(model, tmp_path, d))
    assert rc == 2 and expected in one_line(err)
    assert str(d / "train.jsonl") in err


def test_text_records_with_mask_prompt_and_a_config_s_key_names(capsys, model, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    rc, err = lora(capsys, *base(model, tmp_path, d), "--batch-size", 1, "--mask-prompt")
    assert rc == 2 and "--mask-prompt needs prompts" in one_line(err) and str(d / "train.jsonl") in err
    (d / "train.jsonl").write_text(json.dumps({"body": "a b c"}) + "\n")
    config = tmp_path / "c.yaml"
    config.write_text("text_feature: content\n")
    rc, err = lora(capsys, *base(model, tmp_path, d), "--batch-size", 1, "-c", config)
    assert rc == 2 and "mlx-lm's formats are {'content'}" in one_line(err) and "text_feature" in err


def test_adapters_outside_the_blocks_train_with_dropout(capsys, model, tmp_path):
    """mlx-lm adapts any module of the whole model a key names in full
    (model.embed_tokens, lm_head); mlx-pager stopped mid-run on a KeyError,
    then refused them all, then refused them with an active dropout. They
    train, with dropout too (outside.py; mlx-lm's masks: test_outside.py,
    test_trainer.py), and so does a block's module named in full."""
    config = tmp_path / "c.yaml"
    config.write_text(
        "lora_parameters: {rank: 4, scale: 20.0, dropout: 0.1, "
        "keys: [self_attn.q_proj, model.embed_tokens, model.layers.3.mlp.up_proj]}\n"
    )
    # (no validation: its 10 batches took 15 s a run, the 4-bit products
    # of MLX's CPU backend)
    rc, err = lora(capsys, *base(model, tmp_path), "-c", config, "--val-batches", 0)
    assert rc == 0, err
    saved = mx.load(str(tmp_path / "a" / "adapters.safetensors"))
    assert {"model.embed_tokens.lora_b", "model.layers.3.mlp.up_proj.lora_b"} <= set(saved)


def test_a_model_without_its_tokenizer_files_is_named(capsys, model, tmp_path):
    """Where the directory has none of its tokenizer's files, transformers
    fails with a message about converting slow tokenizers (llama, here) or
    builds an empty tokenizer (qwen2) that mlx-lm's dataset code stopped on
    with an IndexError (mlx_lm.lora too). Training and generation name the
    missing files, before anything is written."""
    import shutil

    from mlx_pager.cli import generate_main

    bare = tmp_path / "bare"
    shutil.copytree(model, bare, ignore=shutil.ignore_patterns("tokenizer*", "*.jinja", "special_tokens_map.json"))
    rc, err = lora(capsys, *base(bare, tmp_path))
    line = one_line(err)
    assert rc == 2 and f"the model directory {bare} lacks its tokenizer's files" in line, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
    rc = generate_main(["--model", str(bare), "--prompt", "hi", "--max-tokens", "2", "--memory-budget", "1GB"])
    assert rc == 2 and "lacks its tokenizer's files" in capsys.readouterr().err


def test_an_adapter_path_that_is_a_file_or_a_missing_resume_file_is_named(capsys, model, tmp_path):
    """Each stopped the run after loading, with a bare OSError (File exists)
    or MLX's RuntimeError traceback."""
    flags = base(model, tmp_path)
    (tmp_path / "a").write_text("not a directory")
    rc, err = lora(capsys, *flags)
    assert rc == 2 and f"--adapter-path {tmp_path / 'a'} is a file: choose a directory" in one_line(err), err
    assert (tmp_path / "a").read_text() == "not a directory" and not (tmp_path / "c").exists()
    (tmp_path / "a").unlink()
    rc, err = lora(capsys, *flags, "--resume-adapter-file", tmp_path / "gone.safetensors")
    assert rc == 2 and "--resume-adapter-file" in one_line(err) and "no such file" in err, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_more_layers_than_the_model_has_names_the_most(capsys, model, tmp_path):
    """mlx_lm.lora's default --num-layers 16 on a smaller model: mlx-lm's
    words, then the fix, before anything is written."""
    flags = base(model, tmp_path)
    flags[flags.index("--num-layers") + 1] = 16
    rc, err = lora(capsys, *flags)
    line = one_line(err)
    assert rc == 2 and "Requested to train 16 layers but the model only has 4 layers." in line, err
    assert "Pass --num-layers 4 or fewer (-1 trains every layer)." in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("name, lines, flags", [("valid", 1, []), ("test", 1, ["--test"])])
def test_a_validation_or_test_set_smaller_than_a_batch_is_refused_before_training(
    capsys, model, tmp_path, name, lines, flags
):
    """mlx-lm's batches need --batch-size records: found only at the first
    validation, or (--test) after the whole training."""
    d = tmp_path / "data"
    d.mkdir()
    for f in ("train", "valid", "test"):
        (d / f"{f}.jsonl").write_text((json.dumps({"text": "hello there"}) + "\n") * (lines if f == name else 4))
    rc, err = lora(capsys, *base(model, tmp_path, d), "--batch-size", 2, *flags)
    assert rc == 2 and f"{name}.jsonl has 1 records, fewer than --batch-size 2" in one_line(err)
    assert not (tmp_path / "a").exists()


def test_hub_ids_with_dots_are_ids_and_paths_are_paths():
    from mlx_pager.checks import check_model, looks_like_path

    for repo in ("mlx-community/Llama-3.2-1B-Instruct-4bit", "Qwen/Qwen2.5-0.5B", "owner/name"):
        assert not looks_like_path(repo), repo
        check_model(repo)  # left to mlx-lm (the hub), not refused here
    for path in ("/m", "./m", "../m", "~/m", "m", "a/b/c", ".x/m", "a/m.git", "a--b/m", "a/-m", "a/m."):
        assert looks_like_path(path), path
        with pytest.raises(FileNotFoundError, match="no such directory"):
            check_model(path)


def test_lora_parameters_without_a_key_are_refused(capsys, model, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lora_parameters:\n  rank: 4\n  dropout: 0.0\n")
    rc, err = lora(capsys, *base(model, tmp_path), "-c", cfg)
    assert rc == 2 and "lora_parameters lacks scale" in one_line(err)


def test_missing_data_dir_and_model_dir(capsys, model, tmp_path):
    rc, err = lora(capsys, *base(model, tmp_path, tmp_path / "nodata"))
    assert rc == 2 and "--data" in one_line(err) and "no such directory" in err
    rc, err = lora(capsys, *base(tmp_path / "nomodel", tmp_path))
    assert rc == 2 and "--model" in one_line(err) and "no such directory" in err
    (tmp_path / "empty").mkdir()
    rc, err = lora(capsys, *base(tmp_path / "empty", tmp_path))
    assert rc == 2 and "config.json" in one_line(err)


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--batch-size", 0, "--batch-size must be a whole number of at least 1"),
        ("--readahead", -1, "--readahead must be 0"),
        ("--page-parts", 0, "--page-parts must be 'auto', 1"),
        ("--prefix-ahead", 0, "--prefix-ahead must be 'auto', 1 (off)"),
        ("--iters", -1, "--iters must be a whole number of at least 1 (or 0 to write untrained adapters)"),
        ("--num-layers", -2, "--num-layers must be a whole number of at least 1 (or 0 or -1 for all)"),
        ("--val-batches", -2, "(or -1 for all, 0 for none)"),
        ("--memory-budget", "abc", "invalid --memory-budget 'abc'"),
    ],
)
def test_bad_flags_before_anything_heavy(capsys, model, tmp_path, flag, value, expected):
    rc, err = lora(capsys, *base(model, tmp_path), "--store", "swap", flag, value)
    assert rc == 2 and expected in one_line(err)
    assert not (tmp_path / "c").exists()  # no swap file written before the refusal


def test_budget_above_physical_memory_is_warned(capsys, model, tmp_path):
    rc, err = lora(capsys, *base(model, tmp_path), "--memory-budget", "99999TB", "--val-batches", 1)
    assert rc == 0
    assert "more than this machine's" in err and "warning" in err


def test_cli_errors_have_no_traceback_in_a_subprocess(model, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_pager.cli", "lora", *map(str, base(model, tmp_path)), "--batch-size", "0"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and out.stderr.strip().startswith("mlx-pager: --batch-size")
    assert "Traceback" not in out.stderr


def test_blocks_patched_by_mlx_lm_grad_checkpoint_are_refused(capsys, model, tmp_path):
    """mlx-lm's --grad-checkpoint patches the block class for the whole
    process; a later mlx-pager run in it is refused, naming the fix, where
    it would stop on a full page budget mid-step."""
    import mlx_lm.tuner.trainer as lm_trainer
    from mlx_lm.utils import load_model

    m, _ = load_model(model, lazy=True)
    with mlx_lm_class_patches_undone():
        lm_trainer.grad_checkpoint(m.layers[0])
        rc, err = lora(capsys, *base(model, tmp_path))
    assert rc != 0
    assert "grad_checkpoint earlier in this process" in err and "fresh process" in err
    assert not (tmp_path / "a" / "adapters.safetensors").exists()


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "4bit"])
def test_experts_the_backend_cannot_multiply_are_named_before_anything_is_paged(capsys, tmp_path, dtype):
    """MLX's CPU backend runs gather_mm (an unquantized mixture-of-experts
    layer's experts) in float32 only: a bf16 mixtral failed in its first
    validation with a traceback, as mlx_lm.lora does. Refused in one line
    where the backend cannot (asked of the backend, so Metal is not), for
    training and generation alike; a float32 one (gather_mm) and a 4-bit one
    (gather_qmm) train."""
    import mlx.core as mx

    from mlx_pager import architectures as A
    from mlx_pager.cli import generate_main

    path = A.build("mixtral", dtype, tmp_path / "m")
    try:
        mx.eval(
            mx.gather_mm(
                mx.zeros((1, 1, 1, 4), mx.bfloat16),
                mx.zeros((2, 4, 2), mx.bfloat16),
                rhs_indices=mx.array([[1]], mx.uint32),
            )
        )
        refused = False
    except RuntimeError:
        refused = dtype == "bf16"
    rc, err = lora(capsys, *base(path, tmp_path), "--batch-size", 2)
    if not refused:
        assert rc == 0, err
        return
    assert rc == 2 and "mixtral: its mixture-of-experts layers hold bfloat16 weights" in one_line(err), err
    assert "Use a quantized model" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
    rc = generate_main(["--model", str(path), "--prompt", "hi", "--max-tokens", "2", "--memory-budget", "1GB"])
    assert rc == 2 and "hold bfloat16 weights" in capsys.readouterr().err


@pytest.mark.parametrize("max_tokens", [0, -2])
def test_generate_refuses_a_max_tokens_it_cannot_take_before_loading(capsys, model, max_tokens):
    """mlx-lm's stream_generate raised it with a traceback, after loading."""
    from mlx_pager.cli import generate_main

    with pytest.raises(SystemExit) as e:
        generate_main(["--model", str(model), "--prompt", "hi", "--max-tokens", str(max_tokens)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--max-tokens must be at least 1, or -1 for no limit, not {max_tokens}" in err
    assert "Traceback" not in err and "Loading" not in err
