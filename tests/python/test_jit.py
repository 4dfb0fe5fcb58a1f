"""Where a compiled tail fits (jit.py): the CPU backend's compiler kept out
of budgets the memory limit (memlimit.py) leaves no room beside."""

import mlx.core as mx
import pytest

from mlx_pager import jit


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's compiler")
def test_a_tail_is_compiled_on_the_cpu_only_with_room_for_the_compiler():
    budget = 1 << 30
    assert jit.tail_compile_refused(budget, limit=budget + jit.COMPILER_BYTES) is None
    why = jit.tail_compile_refused(budget, limit=budget + jit.COMPILER_BYTES - 1)
    assert why and "uncompiled" in why and "1.07GB" in why, why
    assert jit.tail_compile_refused(None, limit=budget) is None  # no budget to keep


def test_a_session_under_a_tight_limit_runs_its_step_uncompiled(models, tmp_path, monkeypatch):
    """The session asks jit before it builds its Blocks: under a limit that
    leaves the compiler no room nothing is compiled (the tail, the blocks,
    and through mx.disable_compile MLX's own compiled functions), with the
    same losses."""
    from test_session import run_one_step

    from mlx_pager import step
    from mlx_pager.callbacks import PagerCallback

    made = []
    blocks = step.Blocks

    def spy(*a, **k):
        made.append(blocks(*a, **k))
        return made[-1]

    monkeypatch.setattr(step, "Blocks", spy)
    model = models("llama", None, hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
    monkeypatch.setattr(jit, "memory_limit", lambda: None)  # whatever this machine has
    roomy = run_one_step(model, tmp_path, "roomy", memory_budget="2GB")
    monkeypatch.setattr(jit, "memory_limit", lambda: 2 * 10**9 + jit.COMPILER_BYTES - 1)

    class Seen(PagerCallback):
        def on_session(self, s):
            self.session, self.disabled = s, s.compile_disabled

    seen = Seen()
    tight = run_one_step(model, tmp_path, "tight", seen, memory_budget="2GB")
    gpu = mx.default_device().type != mx.DeviceType.cpu
    assert [b.tail.compile for b in made] == [True, gpu]
    assert [b.compile for b in made] == [True, gpu]  # the blocks' kernels too
    # and mx.compile itself (MLX's own compiled activations, the update),
    # for the session only
    assert seen.disabled == (not gpu) and not seen.session.compile_disabled
    assert tight.train_losses == roomy.train_losses


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's compiler")
def test_the_uncompiled_note_says_what_it_costs_muon(models, tmp_path, monkeypatch, capsys):
    """With mx.compile off the optimizer update is uncompiled too: the same
    bits for Adam, not for Muon (its bf16 Newton-Schulz: docs/design.md).
    The run's Note says so where the optimizer is Muon, and only there."""
    from test_session import run_one_step

    model = models("llama", None)
    monkeypatch.setattr(jit, "memory_limit", lambda: 10**9 + jit.COMPILER_BYTES - 1)
    notes = {}
    for opt in ("adam", "muon"):
        run_one_step(model, tmp_path, opt, memory_budget="1GB", optimizer=opt, quiet=False)
        out = " ".join(capsys.readouterr().out.split())  # (the console wraps its lines)
        notes[opt] = out.split("Note: ")[1:]
    assert notes["adam"] and "runs uncompiled" in notes["adam"][0] and "Muon" not in notes["adam"][0]
    assert notes["muon"] and "the Muon update then differs from mlx_lm.lora's in the last bits" in notes["muon"][0]
