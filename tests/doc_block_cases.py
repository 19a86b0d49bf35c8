"""Rank bodies for tests/test_doc_blocks.py: the documentation's Python blocks, run as written on gloo ranks.

A block is a user's program with parts left out: names it reads but never binds (``optimizer``, ``prompts``) and
placeholders, ``name = ...  # your ...``, where the user's own code goes. A block's :class:`Setup` supplies those
parts and nothing else:

- ``prelude(ns, extra)`` binds the free names before the block's first line runs;
- ``fills[name](ns)`` is evaluated in place of the placeholder ``name = ...``, at that line (so after the block's
  own earlier lines: after it initialised Megatron's parallel state, say); a fill may also bind a name the user's
  code makes beside it (the distributed optimizer built with the model);
- ``on_value[source](ns, value)`` runs when a bare expression line (``engine.rollout_model``) is evaluated, at that
  moment in the block: what the line's comment says of the value is checked there;
- ``check(ns, values, extra)`` compares what the block produced with what its text and comments say, against an
  independent computation (the training layout's forward, transformers' logits), and returns a small summary.

Every other line runs as written, numbered as in the Markdown file (a traceback names the page and its line). The
names the setup binds must be exactly the block's free names: a setup for a name the block no longer reads, or a
block reading a name nobody binds, fails.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import os
from types import CodeType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

FILL = "__doc_fill__"
VALUE = "__doc_value__"
EOS = 7  # the prompts' stop token (a random tiny model seldom emits it: most sequences run to the limit)
VOCAB = 250  # tiny_llama's real vocabulary (256 padded rows at every TP size)
LOGP_ATOL = 1e-4  # generated log-probs against a training-layout forward (fp32; tests/test_inference.py: 1e-5)
LOGITS_ATOL = 1e-4  # rollout-layout logits against training-layout logits (fp32, another reduction order)


# -- compiling a block ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Compiled:
    code: CodeType
    placeholders: list[str]
    """Names assigned ``...`` at the top level of the block, in order."""
    free: set[str]
    """Names the block reads and never binds (builtins aside): what a setup must supply."""


def _bound_names(tree: ast.Module) -> set[str]:
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound


def compile_block(text: str, filename: str, fence_line: int) -> Compiled:
    """Compile a block's text: ``name = ...`` at the top level becomes ``name = __doc_fill__("name")`` and a bare
    expression line ``expr`` becomes ``__doc_value__("expr", expr)``; line numbers are the Markdown file's (the
    block's first line is ``fence_line + 1``)."""
    tree = ast.parse(text, filename=filename)
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    free = loaded - _bound_names(tree) - set(dir(builtins))
    placeholders = []
    for i, node in enumerate(tree.body):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and node.value.value is Ellipsis):
            name = node.targets[0].id
            placeholders.append(name)
            node.value = ast.copy_location(
                ast.Call(ast.Name(FILL, ast.Load()), [ast.Constant(name)], []), node.value)
        elif isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant):
            tree.body[i] = ast.copy_location(ast.Expr(ast.Call(
                ast.Name(VALUE, ast.Load()), [ast.Constant(ast.unparse(node.value)), node.value], [])), node)
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, fence_line)
    return Compiled(compile(tree, filename, "exec"), placeholders, free)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a block leaves out (see the module's docstring). ``world_size`` gloo ranks run it; the harness sets up
    parallel state at ``tensor`` × ``pipeline`` first, torn down before the block when it makes its own
    (``own_parallel_state``: it calls ``initialize_model_parallel``)."""

    world_size: int
    prelude: Callable[[dict, dict], None]
    check: Callable[[dict, dict, dict], Any]
    fills: dict[str, Callable[[dict], Any]] = dataclasses.field(default_factory=dict)
    on_value: dict[str, Callable[[dict, Any], None]] = dataclasses.field(default_factory=dict)
    tensor: int = 1
    pipeline: int = 1
    own_parallel_state: bool = False
    why: str = ""
    """Why the setup is what it is (the sizes, the model): documentation for the reader of a failure."""
    slow: bool = False
    """In the slow tier (8 ranks: starting their pool alone takes about 40 s on 2 cores)."""
    fixture: Optional[str] = None
    """A fixture of tests/test_doc_blocks.py whose value (picklable) the prelude and the check get as ``extra``."""


def run_block(key: str, filename: str, fence_line: int, text: str, extra: Optional[dict] = None) -> Any:
    """On every rank: run the block under its setup, then its check; the check's summary goes back."""
    from megatron.core import parallel_state as ps

    setup = SETUPS[key]
    extra = dict(extra or {})
    compiled = compile_block(text, filename, fence_line)
    if set(compiled.placeholders) != set(setup.fills):
        raise AssertionError(f"{key}: the block's placeholders {compiled.placeholders} are not the setup's fills "
                             f"{sorted(setup.fills)}")
    values: dict[str, Any] = {}
    bound: set[str] = set()
    ns: dict[str, Any] = {"__name__": "__doc_block__"}

    def fill(name: str) -> Any:
        before = set(ns)
        value = setup.fills[name](ns)
        bound.update(set(ns) - before)
        return value

    def record(source: str, value: Any) -> Any:
        if source in setup.on_value:
            setup.on_value[source](ns, value)
        values[source] = value
        return value

    cwd = os.getcwd()
    try:
        setup.prelude(ns, extra)
        bound.update(n for n in ns if not n.startswith("__"))
        if bound - compiled.free:
            raise AssertionError(f"{key}: the setup binds {sorted(bound - compiled.free)}, which the block does not "
                                 f"read (its free names: {sorted(compiled.free)})")
        if setup.own_parallel_state:
            ps.destroy_model_parallel()
        ns[FILL], ns[VALUE] = fill, record
        exec(compiled.code, ns)
        if bound != compiled.free:
            raise AssertionError(f"{key}: the setup bound {sorted(bound)}, the block's free names are "
                                 f"{sorted(compiled.free)}")
        missing = set(setup.on_value) - set(values)
        if missing:
            raise AssertionError(f"{key}: the block has no bare expression line {sorted(missing)} any more")
        return setup.check(ns, values, extra)
    finally:
        os.chdir(cwd)


# -- shared pieces -----------------------------------------------------------------------------------------------

def _prompts(count: int = 4) -> list[list[int]]:
    """Fixed prompts (lengths 3..40), the same on every rank."""
    g = torch.Generator().manual_seed(2024)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 41, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


_STASH: dict[str, Any] = {}
"""What a fill computed for the later checks (kept out of the block's namespace)."""


def _training_model(ns: dict, *, max_position_embeddings: int = 2048, train: bool = False):
    """The user's model code in small: a tiny Llama stage on the current parallel state in Megatron DDP, the
    distributed optimizer built before the engine (bound as ``optimizer``), the training layout's logits on fixed
    tokens stashed for the checks. ``train``: one optimizer step first (the optimizer then has states)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid.megatron.models import tiny_llama

    from tests.distopt_cases import Config, build, train_step

    model_parallel_cuda_manual_seed(1234)  # Megatron-LM's initialize does this after initialize_model_parallel
    arch = tiny_llama(max_position_embeddings=max_position_embeddings)
    model, make_optimizer = build(Config(distopt=True), arch)
    ns["optimizer"] = optimizer = make_optimizer()
    if train:
        train_step(model, optimizer, 0)
    _STASH.clear()
    _STASH["model"] = model
    _STASH["training_logits"] = _logits(model.module, _probe_tokens())
    return model


def _probe_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(11))


def _logits(chunk, tokens: torch.Tensor, groups: Optional[dict] = None) -> Optional[torch.Tensor]:
    """Full-vocabulary logits of ``chunk`` on the last stage of its pipeline (``groups``: the rollout groups, else
    Megatron's), None on the other stages."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.forward import gather_vocab, pipeline_forward

    pp = groups["pp"] if groups else ps.get_pipeline_model_parallel_group()
    tp = groups["tp"] if groups else ps.get_tensor_model_parallel_group()
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = pipeline_forward(chunk, pp, tokens, positions)
    return None if logits is None else gather_vocab(logits, tp).float()[..., :VOCAB]


def _rollout_model_is_the_training_model(ns: dict, rollout_model) -> None:
    """``engine.rollout_model  # a megatron-core GPTModel on the rollout groups (.pg_collection)``: it is one, on
    the engine's rollout groups, and it computes the training model's logits."""
    from megatron.core.models.gpt import GPTModel

    engine = ns["engine"]
    assert isinstance(rollout_model, GPTModel), type(rollout_model)
    pg = rollout_model.pg_collection
    assert (pg.tp.size(), pg.pp.size()) == (engine.layout.t_g, engine.layout.p_g), (pg.tp.size(), pg.pp.size())
    assert dist.get_process_group_ranks(pg.tp) == dist.get_process_group_ranks(engine.groups["tp"])
    logits = _logits(rollout_model, _probe_tokens(), engine.groups)
    # The two layouts' last stages may be different ranks: compare where both are (rank by rank, the same tokens).
    reference = _STASH["training_logits"]
    if logits is not None and reference is not None:
        torch.testing.assert_close(logits, reference, rtol=0, atol=LOGITS_ATOL)
    _STASH["rollout_logits_compared"] = logits is not None and reference is not None
    _STASH["rollout_logits_on_this_rank"] = logits is not None


def _report_as_commented(report: dict) -> None:
    """``engine.communication_report()  # {"total_bytes": bytes this rank received, "collectives": [...],
    "phases": {"map_seconds", "collectives_seconds", ...}, ...}``."""
    assert isinstance(report["total_bytes"], int) and report["total_bytes"] >= 0, report["total_bytes"]
    assert isinstance(report["collectives"], list) and report["collectives"], report["collectives"]
    assert {"map_seconds", "collectives_seconds"} <= set(report["phases"]), report["phases"]


def _check_results(results, prompts, *, new_tokens: int, eos: int, model) -> dict:
    """``results: one per prompt, in order, with .generated_tokens and .generated_log_probs (log p under the
    untempered distribution over the real vocabulary)``: the log-probs against one forward of the training model
    over each whole sequence (tests.inference_cases.teacher_forced_log_probs), a stop token only at the end."""
    from tests.inference_cases import teacher_forced_log_probs

    assert len(results) == len(prompts), (len(results), len(prompts))
    generated = []
    for r, prompt in zip(results, prompts):
        tokens, logp = list(r.generated_tokens), list(r.generated_log_probs)
        assert list(r.prompt_tokens) == prompt, "results are not in prompt order"
        assert 1 <= len(tokens) <= new_tokens and len(logp) == len(tokens), (len(tokens), len(logp))
        assert all(0 <= t < VOCAB for t in tokens), "a token outside the real vocabulary"
        assert eos not in tokens[:-1] and (len(tokens) == new_tokens or tokens[-1] == eos), tokens
        generated.append(tokens)
    reference = teacher_forced_log_probs(model.module, prompts, generated)
    if reference is not None:
        for r, ref in zip(results, reference):
            torch.testing.assert_close(torch.tensor(r.generated_log_probs), torch.tensor(ref), rtol=0,
                                       atol=LOGP_ATOL)
    return {"generated": [len(t) for t in generated], "log_probs_checked": reference is not None}


# -- README.md and docs/engine.md: "Using the engine" ------------------------------------------------------------

def _engine_prelude(ns: dict, extra: dict) -> None:
    pass  # the model and its optimizer come from the placeholder's fill


def _generate_prelude(ns: dict, extra: dict) -> None:
    ns["prompts"] = _prompts()
    ns["tokenizer_vocab_size"] = VOCAB
    ns["eos_id"] = EOS
    ns["step"] = 3


def _engine_check(ns: dict, values: dict, extra: dict) -> dict:
    engine = ns["engine"]
    _report_as_commented(values["engine.communication_report()"])
    assert engine.mode == "closed", engine.mode
    out = {"total_bytes": values["engine.communication_report()"]["total_bytes"],
           "logits_compared": _STASH["rollout_logits_compared"],
           "rollout_last_stage": _STASH["rollout_logits_on_this_rank"]}
    if "results" in ns:
        # After close(): the model keeps training and computing, on its own storage.
        out |= _check_results(ns["results"], ns["prompts"], new_tokens=256, eos=ns["eos_id"], model=ns["model"])
    return out


# -- docs/generation.md ------------------------------------------------------------------------------------------

def _generation_prelude(ns: dict, extra: dict) -> None:
    from megatron_hybrid import HybridEngine, RolloutLayout

    model = _training_model(ns, train=True)  # binds optimizer; one step: Adam has states to offload
    ns["engine"] = HybridEngine(model, RolloutLayout(1, 1), optimizer=ns["optimizer"])
    _generate_prelude(ns, extra)


def _generation_check(ns: dict, values: dict, extra: dict) -> dict:
    from megatron_hybrid.megatron import compat

    engine, optimizer = ns["engine"], ns["optimizer"]
    report = values["engine.communication_report()['generation']"]
    # "CUDA graph captures / replays, decode steps, KV-cache bytes"; the cache as GenerationConfig asked.
    for key in ("cuda_graph_captures", "cuda_graph_replays", "decode_steps", "kv_cache_bytes"):
        assert key in report, (key, sorted(report))
    assert report["kv_cache_slot_tokens"] == 2048 and 0 < report["kv_cache_bytes"] <= 8 * 2**30, report
    assert report["decode_steps"] >= max(map(len, (r.generated_tokens for r in ns["results"]))) - 1, report
    # "optimizer states and grads to host": their storages hold nothing while rolling out.
    assert engine.mode == "rollout", engine.mode
    states = [t for s in optimizer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    grads = compat.ddp_grad_buffers(_STASH["model"])
    assert states and grads, "nothing to offload: the check would pass vacuously"
    left = [t.untyped_storage().nbytes() for t in states + grads if t.untyped_storage().nbytes()]
    assert not left, f"{len(left)} optimizer states or gradient buffers still hold {sum(left)} bytes"
    engine.switch_to_training()  # brings them back
    assert all(t.untyped_storage().nbytes() for t in states + grads)
    out = _check_results(ns["results"], ns["prompts"], new_tokens=256, eos=ns["eos_id"], model=_STASH["model"])
    engine.close()
    return out


# -- docs/converter.md -------------------------------------------------------------------------------------------

def _converter_prelude(ns: dict, extra: dict) -> None:
    """The block's ``./qwen-mcore`` is a tiny Qwen2 converted by tools/convert_checkpoint.py's library (at TP 1),
    in ``extra["cwd"]``; the block builds and loads it at this rank's TP 2."""
    from megatron.core import parallel_state as ps

    os.chdir(extra["cwd"])
    ns["tp"], ns["pp"] = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ns["tp_rank"] = ps.get_tensor_model_parallel_rank()
    ns["is_first_stage"], ns["is_last_stage"] = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()


def _converter_check(ns: dict, values: dict, extra: dict) -> dict:
    """The loaded model's logits (gathered over TP) against transformers' on the Hugging Face original."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.convert.verify import DEFAULT_ATOL, compare
    from megatron_hybrid.forward import gather_vocab, pipeline_forward

    model, arch = ns["model"], ns["arch"]
    model.eval()
    tokens = extra["tokens"]
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = pipeline_forward(model, ps.get_pipeline_model_parallel_group(), tokens, positions)
    if logits is None:
        return None
    logits = gather_vocab(logits, ps.get_tensor_model_parallel_group()).float()[..., :arch.vocab_size]
    result = compare(extra["hf_logits"], logits)
    assert result.passed(DEFAULT_ATOL), result.report(DEFAULT_ATOL)
    return {"max_abs_diff": result.max_abs_diff, "tp": ns["tp"]}


SETUPS: dict[str, Setup] = {
    "README.md#1": Setup(
        world_size=8, prelude=_generate_prelude, check=_engine_check, fills={"model": _training_model},
        on_value={"engine.rollout_model": _rollout_model_is_the_training_model}, own_parallel_state=True, slow=True,
        why="the block's own sizes, training TP 4 × PP 2 → rollout TP 2: 8 ranks; the model is a tiny Llama with "
            "2,048 positions (max_sequence_length=2048) in DDP with the distributed optimizer"),
    "docs/engine.md#1": Setup(
        world_size=8, prelude=_engine_prelude, check=_engine_check, fills={"model": _training_model},
        on_value={"engine.rollout_model": _rollout_model_is_the_training_model}, own_parallel_state=True, slow=True,
        why="as README.md's block, without generate"),
    "docs/generation.md#1": Setup(
        world_size=2, prelude=_generation_prelude, check=_generation_check, tensor=2,
        why="an engine from training TP 2 to rollout TP 1 (micro-DP 2) over DDP and the distributed optimizer, "
            "after one training step"),
    "docs/converter.md#1": Setup(
        world_size=2, prelude=_converter_prelude, check=_converter_check, tensor=2, fixture="converted_qwen",
        why="a tiny Qwen2 converted at TP 1, read at TP 2"),
}
