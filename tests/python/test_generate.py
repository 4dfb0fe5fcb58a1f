"""Paged generation against mlx-lm's own: the same greedy tokens (same model,
adapters trained by the paged trainer, prompt, seed), MIN's reads per decode
step, clear one-line errors, and a hard memory cap under which mlx_lm.generate
is killed while mlx-pager generate finishes."""

import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from cgroup import run_capped, unavailable_reason
from conftest import quick_adapters

from mlx_pager import modelgen
from mlx_pager.budget import BudgetError
from mlx_pager.generate import load_paged, min_reads_per_sweep

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, models):
    """{arch: (model path, adapter dir)}: adapters from a few paged LoRA steps."""
    out = {}
    for arch, bits in (("llama", None), ("qwen3", 4)):
        path = models(arch, bits, num_hidden_layers=6)
        ad = tmp_path_factory.mktemp(f"ad-{arch}")
        # (the validation runs, iterations 1 and 3, are not this file's subject)
        quick_adapters(path, ad, ad / "cache", steps_per_eval=1000, val_batches=1)
        out[arch] = (path, ad)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_equal_mlx_lm(trained, tmp_path, arch):
    path, ad = trained[arch]
    model, tok = mlx_lm.load(str(path), adapter_path=str(ad))
    mx.random.seed(0)
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=24)]
    del model

    paged, ptok = load_paged(str(path), adapter_path=str(ad), ssd_cache_dir=str(tmp_path / "c"))
    # A page budget of two blocks out of six: pages are read every token.
    pages = [paged.weights.page_bytes(i) for i in range(paged.weights.num_blocks)]
    paged2, _ = load_paged(
        str(path), adapter_path=str(ad), ssd_cache_dir=str(tmp_path / "c"), page_budget=2 * (max(pages) + 4096)
    )
    # The default budget holds every block: one lazy graph per token, as the
    # model's own; two blocks out of six: block by block.
    assert paged.holds_all() and not paged2.holds_all()
    for pm in (paged, paged2):
        mx.random.seed(0)
        got = [r.token for r in mlx_lm.stream_generate(pm, ptok, PROMPT, max_tokens=24)]
        assert got == ref
    s = paged2.summary()
    assert s["decode_tokens"] >= 20 and s["decode_bytes"] > 0
    # Bytes read per decode step: Belady's minimum for the budget (one
    # page of slack for where in MIN's cycle the tokens start and stop).
    assert s["decode_bytes"] <= s["min_bytes_per_token"] * s["decode_tokens"] + max(pages) + 4096
    assert paged.summary()["decode_bytes"] == 0  # everything fits: nothing read after warm-up
    # What the tokens waited for the pager: the reads MIN cannot overlap
    # (its victim is the block in use), within the tokens' own time; none
    # where nothing is read.
    assert 0 < s["decode_wait_s"] < s["decode_s"]
    assert paged.summary()["decode_wait_s"] == 0


def test_blocks_in_parts_generate_the_same_tokens(trained, tmp_path):
    """Each block in 2 pages (--page-parts 2), bound whole per block, at a
    budget of two blocks: the tokens are mlx-lm's."""
    path, ad = trained["llama"]
    model, tok = mlx_lm.load(str(path), adapter_path=str(ad))
    mx.random.seed(0)
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=12)]
    del model
    probe, _ = load_paged(str(path), adapter_path=str(ad), ssd_cache_dir=str(tmp_path / "c"), page_parts=2)
    assert all(len(p) == 2 for p in probe.weights.block_pages)
    two = 2 * probe.weights.max_block_footprint + 4 * 4096
    del probe
    paged, ptok = load_paged(
        str(path), adapter_path=str(ad), ssd_cache_dir=str(tmp_path / "c"), page_parts=2, page_budget=two
    )
    mx.random.seed(0)
    assert [r.token for r in mlx_lm.stream_generate(paged, ptok, PROMPT, max_tokens=12)] == ref
    assert paged.summary()["decode_bytes"] > 0  # pages were read every token


def test_the_least_page_budget_generates_with_blocks_in_parts(models, tmp_path):
    """At exactly the least page budget load_paged accepts (the largest
    block's charge bound), a block in 4 swap pages a 4 KB page apart: the
    tokens are mlx-lm's. At the bare footprints the block's last part found
    the budget full of the others (one charged a page over, reusing a frame)
    and generation failed with PagerBudgetError."""
    path = models("llama", None)
    model, tok = mlx_lm.load(str(path))
    mx.random.seed(0)
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=8)]
    del model
    kw = dict(ssd_cache_dir=str(tmp_path / "c"), page_parts=4, store="swap")
    probe, _ = load_paged(str(path), **kw)
    least = probe.weights.max_block_charge
    assert least > probe.weights.max_block_footprint
    del probe
    with pytest.raises(BudgetError, match="page_budget .* does not hold one block") as e:
        load_paged(str(path), page_budget=least - 1, **kw)
    assert "in 4 parts" in str(e.value) and "memory-budget" not in str(e.value)
    assert f"at least {least} (" in str(e.value)
    paged, ptok = load_paged(str(path), page_budget=least, **kw)
    mx.random.seed(0)
    assert [r.token for r in mlx_lm.stream_generate(paged, ptok, PROMPT, max_tokens=8)] == ref


@pytest.mark.parametrize("model_type", ["plamo3", "longcat_flash_ngram"])
def test_models_keeping_state_of_their_own_generate_as_mlx_lm_at_the_least_page_budget(tmp_path, model_type):
    """Found by generating every architecture at its least page budget:
    - plamo3's RMSNorm, in eval mode, keeps the weight it last saw beside
      the scale it caches from it: that reference kept each released
      page's frame alive, and the second block found no room ("evicted
      pages are still referenced outside the pager");
    - longcat_flash_ngram's n-gram embedding appends the new tokens to a
      cache of its own, outside the blocks: the head's call (step.head_call)
      appended them again, and decode left mlx-lm's tokens at the second."""
    from mlx_pager import architectures as A

    path = A.build(model_type, "4bit", tmp_path)
    model, tok = mlx_lm.load(str(path))
    mx.random.seed(0)
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=6)]
    del model
    probe, _ = load_paged(str(path), ssd_cache_dir=str(tmp_path / "c"))
    least = probe.weights.max_block_charge
    del probe
    paged, ptok = load_paged(str(path), ssd_cache_dir=str(tmp_path / "c"), page_budget=least)
    mx.random.seed(0)
    assert [r.token for r in mlx_lm.stream_generate(paged, ptok, PROMPT, max_tokens=6)] == ref


@pytest.mark.parametrize("least", [False, True])
def test_blocks_sharing_keys_and_values_generate_as_mlx_lm(tmp_path, least):
    """Gemma 4 E2B-style (carry.py): the last layers have no cache of their
    own and take the keys and values (the whole cache's) of an earlier
    layer. With every block held (one lazy graph) and at the least page
    budget (a block at a time, each evaluated), in prompt chunks and
    decoding: mlx-lm's tokens."""
    from mlx_pager import architectures as A

    path = A.build("gemma4_text", "bf16", tmp_path)
    model, tok = mlx_lm.load(str(path))
    prompt = tok.encode(PROMPT * 2)
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=6, prefill_step_size=8)]
    del model
    budget = None
    if least:
        probe, _ = load_paged(str(path), ssd_cache_dir=str(tmp_path / "c"))
        budget = probe.weights.max_block_charge
        del probe
    paged, _ = load_paged(str(path), ssd_cache_dir=str(tmp_path / "c"), page_budget=budget, prefill_step_size=8)
    assert paged.holds_all() != least
    got = [r.token for r in mlx_lm.stream_generate(paged, tok, prompt, max_tokens=6, prefill_step_size=8)]
    assert got == ref


def test_prompt_chunks_read_each_block_once_per_chunk(trained, tmp_path):
    """Prefill is layer-major per chunk: a chunk's tokens pass through a block
    together, so a block is read at most once per chunk, not once per token;
    the tokens equal mlx-lm's with the same prefill step."""
    path, _ = trained["llama"]
    model, tok = mlx_lm.load(str(path))
    prompt = tok.encode(PROMPT * 3)
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=4, prefill_step_size=16)]
    paged, _ = load_paged(
        str(path),
        ssd_cache_dir=str(tmp_path / "c"),
        prefill_step_size=16,
        page_budget=2 * (paged_page(path, tmp_path) + 4096),
    )
    assert paged.prefill_chunk == 16
    got = [
        r.token for r in mlx_lm.stream_generate(paged, tok, prompt, max_tokens=4, prefill_step_size=paged.prefill_chunk)
    ]
    assert got == ref
    chunks = [c for c in paged.stats.calls if c.tokens > 1]
    assert len(chunks) == -(-(len(prompt) - 1) // 16)
    L = paged.weights.num_blocks
    assert all(c.pages_read <= L for c in chunks)
    # A caller that hands over a longer input than the planned chunk gets it
    # chunked all the same (the logits of every position, lazily).
    cache = mlx_lm.models.cache.make_prompt_cache(paged)
    n = len(paged.stats.calls)
    logits = paged(mx.array(prompt)[None], cache=cache)
    assert len(paged.stats.calls) - n == -(-len(prompt) // 16)
    assert logits.shape[:2] == (1, len(prompt))
    cache_ref = mlx_lm.models.cache.make_prompt_cache(model)
    for t0 in range(0, len(prompt), 16):
        ref_logits = model(mx.array(prompt[t0 : t0 + 16])[None], cache=cache_ref)
    assert mx.array_equal(logits[:, -1], ref_logits[:, -1]).item()


def test_a_prompt_with_nothing_paged_gives_the_models_logits_and_may_cache_its_buffers(trained, tmp_path):
    """Where every block fits, a prompt call evaluates its KV cache, not its
    output (a prefill never uses it): a caller that evaluates the logits gets
    the model's own at every position. MLX may then cache the chunk's
    buffers (the plan holds them); where pages stream, only the governor's
    slack (freed page frames go back to the OS)."""
    from mlx_pager.budget import CACHE_SLACK

    path, _ = trained["llama"]
    model, tok = mlx_lm.load(str(path))
    prompt = mx.array(tok.encode(PROMPT))[None]
    cache_ref = mlx_lm.models.cache.make_prompt_cache(model)
    ref = model(prompt, cache=cache_ref)
    mx.eval(ref, [c.state for c in cache_ref])
    paged, _ = load_paged(str(path), ssd_cache_dir=str(tmp_path / "c"))
    assert paged.holds_all()
    cache = mlx_lm.models.cache.make_prompt_cache(paged)
    logits = paged(prompt, cache=cache)
    assert all(c.offset == prompt.shape[1] for c in cache)
    assert mx.array_equal(logits, ref).item()
    for c, r in zip(cache, cache_ref):
        assert mx.array_equal(c.state[0], r.state[0]).item() and mx.array_equal(c.state[1], r.state[1]).item()
    assert paged.chunk_bytes > 0 and paged.cache_limit == CACHE_SLACK + paged.chunk_bytes
    assert mx.set_cache_limit(CACHE_SLACK) == paged.cache_limit  # MLX's, as set
    page = paged_page(path, tmp_path)
    streamed, _ = load_paged(str(path), ssd_cache_dir=str(tmp_path / "c"), page_budget=2 * (page + 4096))
    assert not streamed.holds_all()
    streamed(prompt, cache=mlx_lm.models.cache.make_prompt_cache(streamed))
    assert streamed.cache_limit == CACHE_SLACK
    assert mx.set_cache_limit(CACHE_SLACK) == CACHE_SLACK


def paged_page(path, tmp_path):
    paged, _ = load_paged(str(path), ssd_cache_dir=str(tmp_path / "c"))
    return max(paged.weights.page_bytes(i) for i in range(paged.weights.num_blocks))


def test_min_reads_per_sweep():
    # 6 equal pages, room for 2: MIN reads 6*(6-2)/(6-1) = 4.8 pages per sweep.
    assert min_reads_per_sweep([10] * 6, 20, sweeps=11) == pytest.approx(48, abs=10)
    assert min_reads_per_sweep([10] * 6, 60) == 0
    assert min_reads_per_sweep([10] * 6, 10) == 60  # one slot: every block read


def cli(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "mlx_pager.cli", *args], capture_output=True, text=True, timeout=600, **kw
    )


def test_cli_generate_matches_mlx_lm_cli(trained, tmp_path):
    path, ad = trained["qwen3"]
    common = [
        "--model",
        str(path),
        "--adapter-path",
        str(ad),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "16",
        "--seed",
        "0",
        "--verbose",
        "False",
    ]
    ref = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", *common], capture_output=True, text=True, timeout=600
    )
    got = cli("generate", *common, "--memory-budget", "2GB", "--ssd-cache-dir", str(tmp_path / "c"))
    assert ref.returncode == 0 and got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == ref.stdout.strip().splitlines()[-1].strip() or got.stdout == ref.stdout
    verbose = cli("generate", *common[:-2], "--memory-budget", "2GB", "--ssd-cache-dir", str(tmp_path / "c"))
    assert "tokens-per-sec" in verbose.stdout and "Pager:" in verbose.stdout, verbose.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "/nonexistent/model"], ["no such directory", "--model"]),
        (["--budget-model"], ["--memory-budget"]),
        (["--memory-budget", "12gb"], ["12GB"]),
        (["--memory-budget", "1MB"], ["too small", "Raise it"]),
        (["--adapter-path", "/nonexistent/ad"], ["--adapter-path", "adapter_config.json"]),
    ],
)
def test_cli_bad_input_is_one_clear_line(trained, tmp_path, args, words):
    path, _ = trained["llama"]
    base = ["--model", str(path), "--max-tokens", "4", "--ssd-cache-dir", str(tmp_path / "c")]
    if args == ["--budget-model"]:  # the model dir exists but is not a model
        args = ["--model", str(tmp_path), "--memory-budget", "1GB"]
        words = ["config.json"]
    r = cli("generate", *base, *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr


def test_make_model(tmp_path):
    r = cli(
        "make-model",
        str(tmp_path / "m"),
        "--layers",
        "2",
        "--hidden-size",
        "64",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--vocab-size",
        "300",
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m" / "config.json").exists()


CAP = 450 * 10**6


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"hard memory cap unavailable: {unavailable_reason()}")
def test_generates_under_cap_where_mlx_lm_is_killed(big_model, tmp_path):
    big = big_model
    assert modelgen.weight_bytes(big) >= 4 * CAP
    common = ["--model", str(big), "--prompt", PROMPT, "--max-tokens", "6", "--seed", "0"]
    proc, peak = run_capped(
        [
            sys.executable,
            "-m",
            "mlx_pager.cli",
            "generate",
            *common,
            "--memory-budget",
            str(CAP),
            "--ssd-cache-dir",
            str(tmp_path / "c"),
        ],
        CAP,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Generation:" in proc.stdout and 0 < peak <= CAP
    print(
        f"\nmlx-pager generate under a {CAP / 1e6:.0f}MB cap: cgroup peak {peak / 1e6:.0f}MB\n"
        + "\n".join(proc.stdout.splitlines()[-4:])
    )
    lm, lm_peak = run_capped([sys.executable, "-m", "mlx_lm", "generate", *common], CAP, timeout=900)
    assert lm.returncode != 0, "mlx_lm.generate fit under the cap: the test model is too small"
    print(f"mlx_lm.generate under the same cap: exit code {lm.returncode} (peak {lm_peak / 1e6:.0f}MB)")


def test_the_least_budget_named_generates_in_small_prompt_chunks(models, tmp_path):
    """Blocks larger than a prompt chunk (a wide MLP: 54 MB pages): the
    chunk shrinks toward 16 tokens where the budget is tight rather than
    keep room one block page needs. The chunk could take one page's worth
    where that left no page, so budgets that held a page beside a small
    chunk were refused (a 4-bit MoE told to give 1.57 GB generated within
    1.35 GB). The least budget a refusal names generates mlx-lm's tokens."""
    import re

    path = models(
        "llama", None, hidden_size=512, num_hidden_layers=3, intermediate_size=8192, vocab_size=512, dtype="float32"
    )
    common = ["--model", str(path), "--prompt", PROMPT, "--max-tokens", "6", "--ignore-chat-template"]
    small = cli("generate", *common, "--memory-budget", "50MB", "--ssd-cache-dir", str(tmp_path / "c"))
    m = re.search(r"it needs at least ([\d.]+)MB \(.* a (\d+)-token prompt chunk", " ".join(small.stderr.split()))
    assert small.returncode == 2 and m, small.stderr[-2000:]
    assert int(m.group(2)) == 16
    least = f"{m.group(1)}MB"
    got = cli(
        "generate", *common, "--memory-budget", least, "--ssd-cache-dir", str(tmp_path / "c"), "--verbose", "False"
    )
    ref = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", *common, "--verbose", "False"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert got.returncode == 0 and ref.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == ref.stdout.strip(), (got.stdout, ref.stdout)


def test_the_plan_counts_the_adapters_once(models, tmp_path):
    """The process's baseline was measured after the adapters were read, so
    a plan counted them twice: in the baseline and as adapters (a MoE's 211
    MB of LoRA on its experts raised the least budget named from 1.08 to
    1.29 GB). With 80 MB of adapters on a 7 MB model, the baseline moves
    by far less than the adapters."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    path = models("llama", None, hidden_size=256, num_hidden_layers=2, intermediate_size=768, dtype="float32")
    lora = {"rank": 2048, "scale": 20.0, "dropout": 0.0}
    model, _ = load_model(path)
    model.freeze()
    linear_to_lora_layers(model, 2, lora)
    adapters = dict(tree_flatten(model.trainable_parameters()))
    ad = tmp_path / "ad"
    ad.mkdir()
    mx.save_safetensors(str(ad / "adapters.safetensors"), adapters)
    (ad / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora})
    )
    size = sum(v.nbytes for v in adapters.values())
    assert size > 60 << 20
    del model, adapters
    kw = dict(ssd_cache_dir=str(tmp_path / "c"), memory_budget="4GB")
    plain, _ = load_paged(str(path), **kw)
    without = plain.plan.baseline
    del plain
    adapted, _ = load_paged(str(path), adapter_path=str(ad), **kw)
    assert adapted.plan.trainable == size
    assert adapted.plan.baseline - without < size // 4, (adapted.plan.baseline, without, size)
