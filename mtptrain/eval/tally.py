"""What an eval run counts per configuration and how it sums it up: `Tally` (tokens, timings per repeat, the
first repeat's outputs and statistics, its exactness record), each configuration's summary against its engine's
baseline (tau and acceptance pooled and per request, median tokens/s and speedup with their spread), and the
verdicts drawn over all of them (unreliable timings, the best configuration per method, how far two engines'
baselines agree). eval/run.py measures; this module only adds up."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from mtptrain.engine.generate import GenerationStats
from mtptrain.eval.exactness import Exactness
from mtptrain.eval.methods import Config


@dataclass
class Tally:
    config: Config
    tokens: int = 0  # the first repeat's (greedy decoding repeats them exactly)
    repeat_tokens: list[int] = field(default_factory=list)  # per repeat, summed over the requests
    repeat_seconds: list[float] = field(default_factory=list)
    repeat_prefill: list[float] = field(default_factory=list)  # per repeat: seconds up to each request's first token
    repeat_requests: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # the first repeat's, per request
    stats: GenerationStats = field(default_factory=GenerationStats)
    categories: dict = field(default_factory=dict)  # category -> [emitted, steps]
    ssd: dict | None = None  # ssd: the speculation cache's hits and misses over the first repeat
    reference: int = 0  # the index of its engine's baseline: its outputs and speedups are checked against that
    requests: list[GenerationStats] = field(default_factory=list)  # the first repeat's, per request
    exactness: Exactness = field(init=False)

    def __post_init__(self):
        self.exactness = Exactness(self.config.label)

    def new_repeat(self) -> None:
        """Open the next repeat's timings."""
        self.repeat_tokens.append(0)
        self.repeat_seconds.append(0.0)
        self.repeat_prefill.append(0.0)
        self.repeat_requests.append(0)

    def add_timing(self, tokens: int, seconds: float, prefill: float = 0.0) -> None:
        """One generation of the current repeat, `prefill` of its `seconds` spent up to its first token."""
        self.repeat_tokens[-1] += tokens
        self.repeat_seconds[-1] += seconds
        self.repeat_prefill[-1] += prefill
        self.repeat_requests[-1] += 1

    def add(self, tokens: list[int], stats: GenerationStats, category: str) -> None:
        """One generation of the first repeat, whose statistics stand for every repeat."""
        self.tokens += len(tokens)
        self.outputs.append(tokens)
        self.stats.merge(stats)
        self.requests.append(stats)
        emitted, steps = self.categories.get(category, (0, 0))
        self.categories[category] = (emitted + stats.emitted, steps + stats.steps)

    def tokens_per_second(self) -> list[float]:
        return [t / s if s else 0.0 for t, s in zip(self.repeat_tokens, self.repeat_seconds)]

    def decoding_tokens_per_second(self) -> list[float]:
        """Per repeat, the tokens after each request's first over the time after it (the inverse of the time
        per output token that serving benchmarks report beside the time to the first one)."""
        return [(t - n) / (s - p) if s > p else 0.0 for t, s, p, n in
                zip(self.repeat_tokens, self.repeat_seconds, self.repeat_prefill, self.repeat_requests)]

    def summary(self, baseline: Tally) -> dict:
        """tau and acceptance pooled over all steps of all requests (as vLLM and SGLang report them), and the
        same averaged per request (as SpecForge reports them); timings against `baseline`, its engine's."""
        s, c = self.stats, self.config
        timed = c.serve is None  # a serving engine's split of a step into drafting and verifying is not read
        decoding = {}
        if timed and self.repeat_requests and all(self.repeat_requests):
            ours, theirs = self.decoding_tokens_per_second(), baseline.decoding_tokens_per_second()
            decoding = {"prefill_ms_per_request": round(1000 * statistics.median(
                            p / n for p, n in zip(self.repeat_prefill, self.repeat_requests)), 3),
                        "prompt_tokens_run": s.prefilled,  # fewer than the prompts hold where a prefix was reused
                        "decoding_speedup": round(statistics.median(a / b if b else 0.0
                                                                    for a, b in zip(ours, theirs)), 4)}
        return {
            "label": c.label, "method": c.method, "engine": c.engine, "k": c.k, "budget": c.budget,
            **({"stop": c.stop} if c.stop else {}),
            **({"draft_temperature": c.draft_temperature} if c.draft_temperature is not None else {}),
            **({"children": c.children} if c.children is not None else {}),
            **({"draft_weights": "int8"} if c.int8 else {}),
            "tokens": self.tokens, **timing_summary(self.repeat_tokens, self.repeat_seconds,
                                                    baseline.tokens_per_second()),
            **decoding,
            "tau": round(s.tau, 4), "steps": s.steps,
            "acceptance": [round(a, 4) for a in s.acceptance()],
            **(per_request_means(self.requests) if c.method != "baseline" else {}),
            "draft_ms_per_step": round(1000 * s.draft_seconds / s.steps, 3) if s.steps and timed else None,
            "verify_ms_per_step": round(1000 * s.verify_seconds / s.steps, 3) if s.steps and timed else None,
            "verified_tokens_per_step": round(s.verified / s.steps, 3) if s.steps else 0.0,
            "tau_by_category": {k: round(e / n, 4) for k, (e, n) in sorted(self.categories.items()) if n},
            **({"ssd": self.ssd} if self.ssd is not None else {}),
            "exactness": self.exactness.record(),
        }


def per_request_means(requests: list[GenerationStats]) -> dict:
    """tau and acceptance per position averaged over the requests (a request that never drafted, an n-gram
    lookup without a match, counts tau 1; a position a request never reached counts 0 for it)."""
    per_request = [(r.tau, r.acceptance()) for r in requests if r.steps]
    if not per_request:
        return {}
    positions = max(len(a) for _, a in per_request)
    return {"tau_per_request": round(statistics.fmean(t for t, _ in per_request), 4),
            "acceptance_per_request": [round(statistics.fmean(a[i] if i < len(a) else 0.0 for _, a in per_request), 4)
                                       for i in range(positions)]}


def timing_summary(tokens: list[int], seconds: list[float], baseline_tps: list[float]) -> dict:
    """Median tokens/s and speedup over the repeats, each repeat's speedup taken against the baseline of that
    same repeat; the spread is (fastest - slowest) / median, unknown (None) after a single repeat."""
    tps = [t / s if s else 0.0 for t, s in zip(tokens, seconds)]
    speedups = [a / b if b else 0.0 for a, b in zip(tps, baseline_tps)]
    speedup = statistics.median(speedups)
    spread = (max(speedups) - min(speedups)) / speedup if len(speedups) > 1 and speedup else None
    return {"repeats": len(seconds), "seconds": round(statistics.median(seconds), 3),
            "seconds_per_repeat": [round(x, 3) for x in seconds],
            "tokens_per_second": round(statistics.median(tps), 3), "speedup": round(speedup, 4),
            "speedup_per_repeat": [round(x, 4) for x in speedups], "speedup_min": round(min(speedups), 4),
            "speedup_max": round(max(speedups), 4), "speedup_spread": None if spread is None else round(spread, 4)}


def engines_agreement(tallies: list[Tally]) -> dict:
    """How often the serving engine's baseline wrote the embedded baseline's answer, token for token (greedy: the
    same up to float near-ties, which bfloat16 and the engines' kernels break differently), and how far the
    answers that differ agree."""
    bases = [t for t in tallies if t.config.method == "baseline"]
    if len(bases) < 2:
        return {}
    ours, theirs = bases[0].outputs, bases[1].outputs
    same = [a == b for a, b in zip(ours, theirs)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
             for a, b, s in zip(ours, theirs, same) if not s]
    return {"baselines_identical": sum(same), "baselines_compared": len(same),
            "first_difference_at": first}


def flag_unreliable(results: dict, max_spread: float, max_other_load: float) -> list[str]:
    """Sets each method's "unreliable" causes ("spread": its speedup varied over the repeats by more than
    max_spread of the median; "load": other processes kept more than max_other_load cores busy, which makes
    every timing of the run suspect); returns the warnings, with their numbers."""
    load = results["machine"].get("other_load")
    loaded = load is not None and load > max_other_load
    warnings = []
    if loaded:
        warnings.append(f"other processes used {load:.2f} CPU cores on average while eval measured (above "
                        f"eval.max_other_load {max_other_load:g}): every tokens/s and speedup of this run is "
                        "unreliable")
    for m in results["methods"]:
        causes = []
        if m["speedup_spread"] is not None and m["speedup_spread"] > max_spread:
            causes.append("spread")
            warnings.append(f"{m['label']}: speedup {m['speedup_min']:.2f}x to {m['speedup_max']:.2f}x over "
                            f"{m['repeats']} repeats, a spread of {m['speedup_spread']:.0%} of its median "
                            f"{m['speedup']:.2f}x (above eval.max_spread {max_spread:.0%})")
        if loaded:
            causes.append("load")
        m["unreliable"] = causes
    return warnings


def best_configs(methods: list[dict]) -> dict:
    """Per method, the configuration with the highest measured speedup (the optimum K or budget here), among
    those without exactness failures."""
    best: dict[str, dict] = {}
    for m in methods:
        if m["method"] == "baseline" or m["exactness"]["failures"]:
            continue
        key = method_key(m)
        if key not in best or (m["speedup"] or 0) > (best[key]["speedup"] or 0):
            best[key] = m
    return {method: m["label"] for method, m in best.items()}


def method_key(m: dict) -> str:
    """A row's method, named with its engine where that is not the embedded one ("vllm chain")."""
    engine = m.get("engine", "embedded")
    return m["method"] if engine == "embedded" else f"{engine} {m['method']}"
