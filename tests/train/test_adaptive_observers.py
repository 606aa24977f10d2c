"""The run's wiring: the observer registry of the TP policy (order, narrow views, the step each
message belongs to), the tensor capture, the DP-sync callback the pipeline calls, and the rule
that DDP's private reducer is touched in one adapter file only."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from taco.comm import CommPolicy
from taco.train.adaptive import FidelityTelemetry, Observers, StepEnd, TensorCapture
from taco.train.config import load_config
from tests.helpers.dist import assert_close, run_distributed

ROOT = Path(__file__).resolve().parents[2]


class _Seen:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def on_message(self, site, op, x, codec, step) -> None:
        self.log.append((self.name, "msg", site, step))

    def on_step_end(self, end: StepEnd) -> None:
        self.log.append((self.name, "end", end.step))
        end.record[self.name] = end.step


def test_observers_see_messages_and_step_ends_in_registration_order():
    policy = CommPolicy(codec="taco")
    hub = Observers(policy)
    assert policy.observer is None  # nothing registered: the policy calls nothing
    log: list = []
    a, b = _Seen("a", log), _Seen("b", log)
    hub.register(a)
    hub.register(b, messages=False)  # step ends only
    assert policy.observer is not None
    hub.begin_step(3)
    x = torch.zeros(4, 8)
    policy.observer("l0.fwd", "all_reduce", x, None)
    rec: dict = {}
    hub.end_step(StepEnd(3, 0.1, rec))
    assert log == [("a", "msg", "l0.fwd", 3), ("a", "end", 3), ("b", "end", 3)]
    assert rec == {"a": 3, "b": 3}


def test_fidelity_telemetry_measures_only_on_its_steps():
    c = load_config(None, ["--compression.telemetry_every=2"]).compression
    policy = CommPolicy(codec="taco")
    hub = Observers(policy)
    tel = hub.register(FidelityTelemetry(policy, c, log=False))
    codec = policy.codec_for("s.fwd", 1 << 12, torch.float32)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))
    for step in (1, 2, 3):
        hub.begin_step(step)
        policy.observer("s.fwd", "all_reduce", x, codec)
        rec: dict = {"step": step}
        hub.end_step(StepEnd(step, 0.0, rec))
        assert ("sqnr_db/s.fwd" in rec) == (step == 2), (step, rec)
    assert rec.keys() == {"step"} and tel.history is not None


def test_tensor_capture_saves_the_steps_it_is_asked_for(tmp_path):
    cap = TensorCapture(tmp_path / "cap", every=2)
    x = torch.arange(6.0).reshape(2, 3)
    for step in (1, 2, 3):  # step indices 0, 1, 2: 0 and 2 are captured
        cap.on_message("l0.fwd", "all_reduce", x * step, None, step)
    names = sorted(p.name for p in (tmp_path / "cap").iterdir())
    assert names == ["l0.fwd.step0.pt", "l0.fwd.step2.pt"]
    assert_close(torch.load(tmp_path / "cap" / "l0.fwd.step2.pt"), x * 3, "captured tensor", rtol=0, atol=0)


def test_torch_private_api_is_touched_in_one_adapter_file_only():
    """The training stack (comm, parallel, train, integrations, models) reaches torch's private API
    through `taco/parallel/torch_private.py` only; the pipeline never names a DP wrapper."""
    private = re.compile(
        r"torch\._[a-zA-Z]|\._local_tensor\b|_execution_engine|\.reducer\b|from torch[\w.]*\._"
    )
    hits = {
        str(p.relative_to(ROOT))
        for d in ("comm", "parallel", "train", "integrations", "models")
        for p in (ROOT / "taco" / d).rglob("*.py")
        if private.search(p.read_text())
    }
    assert hits == {"taco/parallel/torch_private.py"}, hits
    pipeline = (ROOT / "taco/parallel/pipeline.py").read_text()
    assert "DistributedDataParallel" not in pipeline and "is_fully_sharded" not in pipeline  # never asks


class _RecordingSync:
    def __init__(self) -> None:
        self.forwards = 0
        self.backwards: list[bool] = []

    def forward(self):
        self.forwards += 1
        from contextlib import nullcontext

        return nullcontext()

    def before_backward(self, output: torch.Tensor, last: bool) -> None:
        self.backwards.append(last)


def _engine_calls_its_dp_sync(rank: int, world: int) -> tuple[int, list[bool], int, list[bool]]:
    from taco.models import GPT, GPTConfig
    from taco.parallel import ParallelDims, PipelineEngine, PipelineStage

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32, block_size=8))
    dims = ParallelDims(dp=1, pp=1, tp=1).build()
    stage = PipelineStage(model, 0, 1)
    wrapper = torch.nn.Sequential(stage)  # any DP wrapper: the engine needs its sync to be given
    try:
        PipelineEngine(stage, dims, module=wrapper)
        raise AssertionError("a wrapped module without dp_sync was accepted")
    except ValueError as e:
        assert "dp_sync" in str(e), e
    sync = _RecordingSync()
    engine = PipelineEngine(stage, dims, dp_sync=sync)
    x = torch.randint(0, 64, (6, 8))

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    engine.train_step(x, x, 3, loss_fn)
    train = (sync.forwards, list(sync.backwards))
    engine.eval_step(x, x, 3, loss_fn)  # evaluation: no DP sync at all
    return (*train, sync.forwards, sync.backwards)


def test_pipeline_engine_calls_the_dp_sync_it_was_given():
    [(forwards, backwards, forwards_after_eval, backwards_after_eval)] = run_distributed(
        _engine_calls_its_dp_sync, 1
    )
    assert forwards == 3 and backwards == [False, False, True]  # reduce after the last backward only
    assert forwards_after_eval == 3 and backwards_after_eval == [False, False, True]
