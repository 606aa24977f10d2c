"""The [compression] section: which codec compresses which collective, and how TP codecs are chosen.

Why this file exists: the compression knobs grow with the codecs and the policies that choose them
(docs/design.md 1.3-1.4); they live apart from the other sections of `schema.py`, on the same
`_Section` base (typed coercion, per-field docs in `metadata["doc"]`, checks in `_check`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

from taco.codec.specs import codec_config, parse_ladder
from taco.comm.policy import ALL_REDUCE_ALGOS
from taco.train.config.schema import _Section


@dataclass
class CompressionConfig(_Section):
    """[compression]: which codec compresses which collective (docs/design.md 1.3); "none" = plain."""

    SECTION: typing.ClassVar[str] = "compression"

    tp_codec: str = field(default="taco", metadata={"doc": (
        'Codec of the tensor-parallel collectives (a name from `taco.list_codecs()`; "none" = plain), '
        'or a ladder "ladder(int4-hadamard,int5-hadamard,int6-hadamard,taco,none)": each TP site moves '
        "between these codecs (cheapest first) by its measured fidelity (docs/ladder.md).")})
    tp_codec_options: dict[str, Any] = field(default_factory=dict, metadata={"doc": (
        'Keyword options of the TP codec, an inline table, e.g. {group_size=128, fmt="e4m3"}; '
        "on the command line `--compression.tp_codec_options.group_size=64` sets one key.")})
    tp_sites: list[str] = field(default_factory=lambda: ["*"], metadata={"doc": (
        'Glob patterns of the TP communication sites to compress (e.g. "layers.*.mlp.down.fwd"); '
        'other sites use the plain collective. Default ["*"] = all.')})
    min_bytes: int = field(default=0, metadata={
        "doc": "Messages smaller than this many bytes (uncompressed size) use the plain collective."})
    pp_codec: str = field(default="none", metadata={
        "doc": "Codec of the pipeline send/recv of activations and their gradients."})
    pp_codec_options: dict[str, Any] = field(default_factory=dict, metadata={
        "doc": "Keyword options of the PP codec (inline table)."})
    dp_codec: str = field(default="none", metadata={
        "doc": "Codec of the data-parallel gradient all-reduce (a DDP communication hook)."})
    dp_codec_options: dict[str, Any] = field(default_factory=dict, metadata={
        "doc": "Keyword options of the DP codec (inline table)."})
    dp_weight_codec: str = field(default="none", metadata={"doc": (
        "With parallel.dp_shard: codec of the FSDP weight all-gather; weights travel as differences "
        'against a shared reference (e.g. "int8-hadamard"; a spec string carries options).')})
    dp_grad_codec: str = field(default="none", metadata={"doc": (
        "With parallel.dp_shard: codec of the FSDP gradient reduce-scatter (across nodes when "
        'parallel.dp_ranks_per_node splits the DP group), e.g. "int4-hadamard".')})
    dp_grad_intra_codec: str = field(default="", metadata={"doc": (
        'With parallel.dp_ranks_per_node: codec of the intra-node reduce-scatter ("" = dp_grad_codec).')})
    slices: int = field(default=1, metadata={"doc": (
        "Cut each compressed all-reduce into at most this many slices, each of at least "
        "min_slice_bytes, so that encoding, transfer and decoding overlap (1 = no overlap).")})
    min_slice_bytes: int = field(default=1 << 20, metadata={"doc": (
        "Smallest slice (uncompressed bytes): a message of M bytes gets min(slices, M // this) "
        "slices, at least 1. Below ~1 MiB the per-collective latency of the uncapped loopback "
        "outweighs the overlap (docs/design.md 1.3).")})
    tp_all_reduce: str = field(default="auto", metadata={"doc": (
        'Compressed TP all-reduce: "two_shot" (all-to-all, decode-sum-encode, all-gather), "gather" '
        '(one all-gather of every rank\'s encoded message, then decode-sum) or "auto": "gather" at '
        "tp = 2 (the same bytes in one collective per slice instead of two, each element quantized "
        'once), else "two_shot" (docs/design.md 1.3).')})
    min_sqnr_db: float = field(default=28.0, metadata={"doc": (
        "Fidelity floor of a TP site in dB (signal-to-quantization-noise ratio of its messages): "
        "calibration never picks a codec below it and the fidelity guard acts on a site that stays "
        "under it. Default: taco's ~31.8 dB on Hadamard-rotated groups less a 3.8 dB margin.")})
    calibrate: bool = field(default=False, metadata={"doc": (
        "Data-driven reshaping (docs/design.md 1.1): sample every compressed TP site (forward and "
        "backward) during the first calibrate_steps steps, then give each site the candidate with the "
        "best error x bytes score that meets min_sqnr_db and max_bytes_per_elem; the choice goes to "
        "calibration.json in out_dir and is reused on resume. `taco calibrate` runs only this.")})
    calibrate_steps: int = field(default=4, metadata={"doc": (
        "K: steps sampled before the calibration decides (one sample per site and step).")})
    calibration: str = field(default="", metadata={"doc": (
        "Path of a calibration.json (of an earlier run) to apply before the first step instead of "
        'sampling; "" = none.')})
    calibrate_candidates: list[str] = field(default_factory=list, metadata={"doc": (
        'Codec specs calibration chooses from, e.g. ["taco(group_size=64)", "int8-hadamard(axis=0)"]; '
        "[] = tp_codec with its options at every group size of taco.codec.GROUP_SIZES, grouped along "
        "the last axis and along axis 0, plus int8-hadamard and int6-hadamard (their defaults: G = 64, "
        "bf16 scales, signs=auto).")})
    max_bytes_per_elem: float = field(default=0.0, metadata={"doc": (
        "Bytes budget of calibration: no site gets a candidate sending more wire bytes per element "
        "(payload + scales); 0 = no budget.")})
    telemetry_every: int = field(default=25, metadata={"doc": (
        "Every this many steps, round-trip the first message of each compressed TP site through its "
        "codec and log its SQNR and non-finite counts (metrics.jsonl `sqnr_db/<site>`, "
        "`nonfinite/<site>`, TensorBoard, a table in comm_stats.txt); 0 = off.")})
    guard: bool = field(default=True, metadata={"doc": (
        "With telemetry on: switch a TP site whose SQNR stays under min_sqnr_db for guard_patience "
        "checks, or whose codec makes NaN/Inf from finite input (at once), to guard_fallback; one "
        "log line names the site and the numbers.")})
    guard_patience: int = field(default=2, metadata={"doc": (
        "Consecutive telemetry checks under min_sqnr_db before the guard switches a site.")})
    guard_fallback: str = field(default="int8-hadamard", metadata={"doc": (
        "Codec the guard switches a site to (int8-hadamard: ~43 dB on Gaussian data, 1.03 B/elem); "
        'a site already on it goes to "none".')})
    ladder_fwd_sqnr_db: float = field(default=24.0, metadata={"doc": (
        "Ladder tp_codec: SQNR target of forward sites (activations), dB; a site under it moves one "
        "rung up at once. Default: int5-hadamard's worst demo site (25.1 dB) less 1 dB (docs/ladder.md).")})
    ladder_bwd_cos: float = field(default=0.992, metadata={"doc": (
        "Ladder tp_codec: cosine target of backward sites (activation gradients against the "
        "uncompressed value). Default: int4-hadamard's worst demo site (21.9 dB, cos 0.9935) less "
        "~1 dB (docs/ladder.md).")})
    ladder_down_margin_db: float = field(default=6.0, metadata={"doc": (
        "Ladder tp_codec: a site moves one rung down (cheaper) only while its measure is this many dB "
        "above its target (cosines as -10 log10(1 - cos)); one int-N Hadamard rung is ~6 dB.")})
    ladder_confirm_checks: int = field(default=2, metadata={"doc": (
        "Ladder tp_codec: telemetry checks in a row with room to spare before a site moves down.")})
    ladder_max_moves: int = field(default=4, metadata={"doc": (
        "Ladder tp_codec: moves down stop after a site has moved this many times (moves up, for "
        "fidelity, still happen, past a rung it left never again).")})
    ladder_drop_db: float = field(default=15.0, metadata={"doc": (
        "Ladder tp_codec: a site whose measure falls by more than this from its previous reading on "
        'the same rung has collapsed and goes to "none" (logged), as one whose codec makes NaN/Inf.')})
    when: str = field(default="always", metadata={"doc": (
        '"always": tp_codec compresses every site tp_sites selects; "auto": after auto_warmup_steps '
        "compressed steps, time each site's plain and compressed collective on the TP group and keep "
        "the codec only where it is faster by auto_margin (docs/design.md 1.4), re-deciding when the "
        "step times contradict the prediction.")})
    auto_warmup_steps: int = field(default=3, metadata={"doc": (
        'when = "auto": steps run as configured before the first decision (their sites, message sizes '
        "and step times are the decision's input; the first step's start-up cost is left out).")})
    auto_margin: float = field(default=0.03, metadata={"doc": (
        'when = "auto": a site is compressed only if its compressed collective is faster than the plain '
        "one by this fraction (0.03 = 3%), by the medians of the probe and by the lower bound of the "
        "gain from its paired repeats.")})
    auto_repeats: int = field(default=7, metadata={"doc": (
        'when = "auto": timed repeats of each probed collective (median per rank, max over the TP group; '
        "the pairs bound the gain: the 2nd smallest of 7).")})
    auto_check_steps: int = field(default=5, metadata={"doc": (
        'when = "auto": steps after a decision whose median step time is compared with the prediction.')})
    auto_tolerance: float = field(default=0.15, metadata={"doc": (
        'when = "auto": re-probe when the measured step time is slower than the predicted one by more '
        "than this fraction (of the measured one).")})
    auto_max_redecisions: int = field(default=2, metadata={"doc": (
        'when = "auto": at most this many re-probes per run (0: decide once).')})

    def set_tp_codec(self, spec: str) -> None:
        """`tp_codec` and `tp_codec_options` for a codec given as a spec string, as the sweeps name
        them ("int6-hadamard(signs=true)"): the options already set that this codec accepts
        (group_size for group codecs, fmt for FP8 ones, ...), with the spec's own on top."""
        self.tp_codec, self.tp_codec_options = codec_config(spec, self.tp_codec_options)

    def _check(self) -> None:
        for name in ("tp_codec", "pp_codec", "dp_codec", "dp_weight_codec", "dp_grad_codec"):
            if not getattr(self, name).strip():
                self._fail(name, 'must be a codec name, or "none" for the plain collective')
        for name in ("tp_codec_options", "pp_codec_options", "dp_codec_options"):
            for key, value in getattr(self, name).items():
                if not isinstance(value, (str, int, float, bool)):
                    self._fail(name, f"option {key!r} must be a string, number or boolean")
        if not self.tp_sites:
            self._fail("tp_sites", 'must list at least one pattern (tp_codec = "none" compresses nothing)')
        if self.min_bytes < 0:
            self._fail("min_bytes", "must be >= 0")
        if self.slices < 1:
            self._fail("slices", "must be >= 1")
        if self.min_slice_bytes < 1:
            self._fail("min_slice_bytes", "must be >= 1")
        if self.tp_all_reduce not in ALL_REDUCE_ALGOS:
            self._fail("tp_all_reduce", f"must be one of {', '.join(ALL_REDUCE_ALGOS)}")
        if self.calibrate_steps < 1:
            self._fail("calibrate_steps", "must be >= 1")
        if self.max_bytes_per_elem < 0:
            self._fail("max_bytes_per_elem", "must be >= 0 (0 = no budget)")
        if any(not c.strip() or c.strip() == "none" for c in self.calibrate_candidates):
            self._fail("calibrate_candidates", 'must be codec specs (not "" or "none")')
        if (self.calibrate or self.calibration) and self.tp_codec == "none":
            self._fail("tp_codec", 'is "none": calibration chooses among codecs of compressed sites')
        if self.telemetry_every < 0:
            self._fail("telemetry_every", "must be >= 0 (0 = off)")
        if self.guard_patience < 1:
            self._fail("guard_patience", "must be >= 1")
        if not self.guard_fallback.strip():
            self._fail("guard_fallback", 'must be a codec name, or "none" for the plain collective')
        if parse_ladder(self.tp_codec) is not None and self.telemetry_every < 1:
            self._fail("telemetry_every", "must be >= 1 with a ladder tp_codec (its readings move the sites)")
        if not 0.0 < self.ladder_bwd_cos < 1.0:
            self._fail("ladder_bwd_cos", "must be in (0, 1)")
        if self.ladder_down_margin_db < 0 or self.ladder_drop_db <= 0:
            self._fail("ladder_down_margin_db", "and ladder_drop_db must be >= 0 and > 0")
        if self.ladder_confirm_checks < 1 or self.ladder_max_moves < 0:
            self._fail("ladder_confirm_checks", "must be >= 1 (and ladder_max_moves >= 0)")
        if self.when not in ("always", "auto"):
            self._fail("when", 'must be "always" or "auto"')
        for name in ("auto_warmup_steps", "auto_repeats", "auto_check_steps"):
            if getattr(self, name) < 1:
                self._fail(name, "must be >= 1")
        if self.auto_max_redecisions < 0:
            self._fail("auto_max_redecisions", "must be >= 0")
        if not 0.0 <= self.auto_margin < 1.0:
            self._fail("auto_margin", "must be in [0, 1)")
        if self.auto_tolerance <= 0.0:
            self._fail("auto_tolerance", "must be > 0")
