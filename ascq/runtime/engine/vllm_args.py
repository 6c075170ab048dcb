"""vLLM's engine arguments and `vllm serve` flags that ascq has no field or option for: each either changes
nothing here (accepted, with one log line) or is refused in one line naming it.

One table serves both front doors:
- `EngineArgs(...)` / `LLM(...)` keywords (`engine_kwargs`): a vLLM field that changes nothing is dropped
  with a log line; one that would is refused (`UnsupportedError`); an unknown keyword is a one-line
  `TypeError` naming the closest field (ascq's or vLLM's).
- `ascq serve` flags (`split_vllm_flags`): before typer parses the command line, vLLM flags the command does
  not declare are taken out and classified the same way (vLLM's bool flags come as `--x` / `--no-x`, JSON
  flags also as `--x.key value`, like vLLM's FlexibleArgumentParser).

vLLM's full flag list, with the version it was read from, is recorded in tests/data/vllm_serve_flags.json;
tests/test_serve_flags.py checks that every flag in it is an option of `ascq serve` or has an entry here.
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from ascq.core.errors import AscqError, UnsupportedError

logger = logging.getLogger("ascq")

Accepts = Callable[[Any], bool]


def _text(value: Any) -> str:
    return str(value).strip().lower()


def unset(value: Any) -> bool:
    """None / empty, as a Python value or as typed on a command line (`None`, `null`, `{}`)."""
    return value is None or _text(value) in ("", "none", "null", "{}", "[]") or value in ({}, [])


def one_of(*allowed: Any) -> Accepts:
    texts = {_text(a) for a in allowed}
    return lambda value: unset(value) or _text(value) in texts


def is_false(value: Any) -> bool:
    return value is None or value is False or _text(value) in ("false", "0")


def is_true(value: Any) -> bool:
    return value is None or value is True or _text(value) in ("true", "1")


def any_value(_: Any) -> bool:
    return True


@dataclass(frozen=True)
class VllmArg:
    """A vLLM argument ascq has no field / option for. `accepts`: the values that change nothing here (None:
    every value is refused); `reason`: why they change nothing, or why the rest is refused. `kind`: how the
    flag takes its value on vLLM's command line: "bool" (`--x` / `--no-x`), "flag" (`--x`), "value",
    "values" (one or more), "optional" (zero or one). `engine`: a field of vLLM's EngineArgs (else a
    `vllm serve` frontend flag only)."""

    name: str
    kind: str
    accepts: Accepts | None
    reason: str
    engine: bool = True


MULTIMODAL = "ascq serves text-only models, so multimodal settings have no effect"
NO_DATA_PARALLEL = "ascq has no data parallelism (run one server per replica behind a load balancer)"
NO_EXPERT_BALANCING = "ascq places experts statically (no expert load balancing)"
LOCAL_ONLY = "ascq loads local folders and zoo entries (fetch Hub models with `ascq zoo pull`)"
LORA = "LoRA adapters are not supported"
NO_REQUEST_LOG = "ascq does not log requests or outputs"
CUDA_GRAPHS = "ascq captures decode graphs itself (--enforce-eager off); vLLM's capture settings do not apply"
NO_DBO = "ascq has no dual-batch overlap"
NO_MAMBA = "ascq has no Mamba / hybrid models"


def _args(kind: str, accepts: Accepts | None, reason: str, names: str, engine: bool = True) -> list[VllmArg]:
    return [VllmArg(name, kind, accepts, reason, engine) for name in names.split()]


VLLM_ARGS: dict[str, VllmArg] = {
    a.name: a
    for a in [
        # ---- ModelConfig ----
        *_args("value", one_of("auto", "generate"), "ascq runs generative models", "runner"),
        *_args("value", one_of("auto", "none"), "ascq does not convert models to other tasks", "convert"),
        *_args("value", one_of("auto", "generate"), "ascq runs generative models", "task"),
        *_args(
            "value",
            one_of("auto", "hf"),
            "ascq uses the checkpoint's Hugging Face tokenizer",
            "tokenizer_mode",
        ),
        *_args("value", unset, "ascq reads config.json from the model folder", "hf_config_path"),
        *_args("value", unset, MULTIMODAL, "allowed_local_media_path"),
        *_args("values", unset, MULTIMODAL, "allowed_media_domains"),
        *_args("value", unset, LOCAL_ONLY, "revision code_revision tokenizer_revision download_dir"),
        *_args("value", unset, "ascq uses the checkpoint's own RoPE settings", "rope_scaling rope_theta"),
        *_args("value", unset, "ascq uses the checkpoint's own config.json", "hf_overrides"),
        *_args(
            "value",
            one_of("raw_logprobs"),
            "ascq returns the log-softmax of the model's raw logits (vLLM's raw_logprobs)",
            "logprobs_mode",
        ),
        *_args("bool", is_false, "sliding-window models keep their window", "disable_sliding_window"),
        *_args("bool", any_value, "ascq has no cascade attention", "disable_cascade_attn"),
        *_args("bool", is_false, "ascq always loads the tokenizer", "skip_tokenizer_init"),
        *_args("bool", is_false, "prompt embeddings as input are not supported", "enable_prompt_embeds"),
        *_args("value", one_of("auto", "hf"), "ascq reads Hugging Face config.json", "config_format"),
        *_args("optional", any_value, LOCAL_ONLY + "; no Hub access at serve time", "hf_token"),
        *_args(
            "value",
            unset,
            "ascq pools the last token (/v1/embeddings)",
            "pooler_config override_pooler_config",
        ),
        *_args(
            "value", unset, "logits processors by name pattern are not supported", "logits_processor_pattern"
        ),
        *_args("values", unset, "server-wide logits processors are not supported", "logits_processors"),
        *_args("bool", is_false, "sleep mode is not supported", "enable_sleep_mode"),
        *_args("value", one_of("auto", "vllm"), "ascq runs its own model code", "model_impl"),
        *_args("value", unset, "attention runs in the compute dtype (--dtype)", "override_attention_dtype"),
        *_args("value", unset, "IO processor plugins are not supported", "io_processor_plugin"),
        # ---- LoadConfig ----
        *_args("value", one_of("lazy"), "ascq memory-maps safetensors (lazy)", "safetensors_load_strategy"),
        *_args("value", unset, "no model loader options", "model_loader_extra_config"),
        *_args("values", any_value, "only used when downloading; " + LOCAL_ONLY, "ignore_patterns"),
        *_args("bool", any_value, "ascq prints its own loading progress", "use_tqdm_on_load"),
        *_args("value", one_of("cpu"), "ascq does not load .pt checkpoints", "pt_load_map_location"),
        # ---- StructuredOutputsConfig (deprecated guided decoding) ----
        *_args(
            "value",
            one_of("auto", "xgrammar"),
            "ascq's structured outputs use xgrammar",
            "guided_decoding_backend",
        ),
        *_args(
            "value", is_false, "xgrammar has no fallback backend here", "guided_decoding_disable_fallback"
        ),
        *_args(
            "value",
            is_false,
            "JSON whitespace follows xgrammar's defaults",
            "guided_decoding_disable_any_whitespace guided_decoding_disable_additional_properties",
        ),
        *_args(
            "value",
            lambda v: unset(v) or "xgrammar" in _text(v) or "auto" in _text(v),
            "ascq's structured outputs use xgrammar with its defaults",
            "structured_outputs_config",
        ),
        # ---- ParallelConfig ----
        *_args(
            "value",
            one_of("mp", "uni"),
            "ascq runs its ranks as local processes (mp)",
            "distributed_executor_backend",
        ),
        *_args(
            "value",
            one_of("1"),
            "decode context parallelism is not supported",
            "decode_context_parallel_size",
        ),
        *_args("value", one_of("1"), NO_DATA_PARALLEL, "data_parallel_size data_parallel_size_local"),
        *_args(
            "value",
            unset,
            NO_DATA_PARALLEL,
            "data_parallel_rank data_parallel_start_rank data_parallel_address data_parallel_rpc_port",
        ),
        *_args("value", one_of("mp"), NO_DATA_PARALLEL, "data_parallel_backend"),
        *_args("bool", is_false, NO_DATA_PARALLEL, "data_parallel_hybrid_lb"),
        *_args("bool", any_value, NO_DATA_PARALLEL, "disable_nccl_for_dp_synchronization"),
        *_args(
            "value",
            any_value,
            "ascq's expert parallelism exchanges tokens with all-reduce",
            "all2all_backend",
        ),
        *_args("bool", is_false, NO_DBO, "enable_dbo"),
        *_args("value", any_value, NO_DBO, "dbo_decode_token_threshold dbo_prefill_token_threshold"),
        *_args("bool", is_false, NO_EXPERT_BALANCING, "enable_eplb eplb_log_balancedness"),
        *_args("value", unset, NO_EXPERT_BALANCING, "eplb_config eplb_window_size eplb_step_interval"),
        *_args("value", one_of("0"), NO_EXPERT_BALANCING, "num_redundant_experts"),
        *_args("value", one_of("linear"), "ascq places experts linearly", "expert_placement_strategy"),
        *_args("value", any_value, "each rank loads its own shard", "max_parallel_loading_workers"),
        *_args("bool", is_false, "Ray is not used", "ray_workers_use_nsight"),
        *_args("bool", any_value, "ascq has no custom all-reduce", "disable_custom_all_reduce"),
        *_args("value", one_of("auto"), "custom worker classes are not supported", "worker_cls"),
        *_args("value", unset, "worker extensions are not supported", "worker_extension_cls"),
        *_args("flag", any_value, MULTIMODAL, "enable_multimodal_encoder_data_parallel"),
        # ---- CacheConfig ----
        *_args(
            "value", one_of("sha256"), "ascq keys prefix-cache blocks with sha256", "prefix_caching_hash_algo"
        ),
        *_args("bool", is_false, "fp8 KV scales are computed per block by ascq", "calculate_kv_scales"),
        *_args("bool", is_false, "fast-prefill KV sharing is not supported", "kv_sharing_fast_prefill"),
        *_args("value", any_value, NO_MAMBA, "mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size"),
        # ---- MultiModalConfig ----
        *_args(
            "value",
            any_value,
            MULTIMODAL,
            "limit_mm_per_prompt media_io_kwargs mm_processor_kwargs mm_processor_cache_gb "
            "mm_processor_cache_type mm_shm_cache_max_object_size_mb mm_encoder_tp_mode "
            "mm_encoder_attn_backend video_pruning_rate",
        ),
        *_args("bool", is_false, MULTIMODAL, "enable_mm_embeds"),
        *_args("bool", any_value, MULTIMODAL, "interleave_mm_strings skip_mm_profiling"),
        *_args("flag", any_value, MULTIMODAL, "disable_mm_preprocessor_cache"),
        # ---- LoRAConfig ----
        *_args("bool", is_false, LORA, "enable_lora fully_sharded_loras"),
        *_args(
            "value",
            None,
            LORA,
            "max_loras max_lora_rank lora_extra_vocab_size lora_dtype max_cpu_loras default_mm_loras",
        ),
        # ---- ObservabilityConfig ----
        *_args(
            "value",
            any_value,
            "ascq exports no hidden (deprecated) metrics",
            "show_hidden_metrics_for_version",
        ),
        *_args("value", unset, "OpenTelemetry tracing is not supported", "otlp_traces_endpoint"),
        *_args("values", unset, "OpenTelemetry tracing is not supported", "collect_detailed_traces"),
        # ---- SchedulerConfig ----
        *_args(
            "value",
            one_of("1"),
            "ascq prefills one chunk per request at a time",
            "max_num_partial_prefills max_long_partial_prefills",
        ),
        *_args(
            "value",
            one_of("0"),
            "ascq chunks every prefill to the step's token budget",
            "long_prefill_token_threshold",
        ),
        *_args("value", one_of("0"), "lookahead slots come from --speculative-config", "num_lookahead_slots"),
        *_args("value", one_of("fcfs"), "ascq schedules first come, first served", "scheduling_policy"),
        *_args("bool", is_true, "ascq always chunks long prefills", "enable_chunked_prefill"),
        *_args("bool", any_value, MULTIMODAL, "disable_chunked_mm_input"),
        *_args("value", unset, "custom scheduler classes are not supported", "scheduler_cls"),
        *_args("value", unset, "external scheduler parameters are not supported", "external_parameters"),
        *_args("bool", any_value, "ascq has no hybrid KV-cache models", "disable_hybrid_kv_cache_manager"),
        *_args(
            "bool",
            any_value,
            "ascq schedules each step synchronously; results are the same",
            "async_scheduling",
        ),
        # ---- CompilationConfig / VllmConfig ----
        *_args("values", any_value, CUDA_GRAPHS, "cudagraph_capture_sizes cuda_graph_sizes"),
        *_args("value", any_value, CUDA_GRAPHS, "max_cudagraph_capture_size compilation_config"),
        *_args("value", unset, "disaggregated KV transfer is not supported", "kv_transfer_config"),
        *_args("value", unset, "KV cache events are not supported", "kv_events_config"),
        *_args("value", unset, "no platform-specific additional config", "additional_config"),
        # ---- AsyncEngineArgs / other ----
        *_args(
            "flag",
            any_value,
            "ascq logs no periodic engine statistics (see /metrics)",
            "disable_log_stats aggregate_engine_logging",
        ),
        *_args("bool", is_false, NO_REQUEST_LOG, "enable_log_requests"),
        *_args("bool", is_true, NO_REQUEST_LOG, "disable_log_requests"),
        # ---- `vllm serve` frontend (vllm/entrypoints/openai/cli_args.py) ----
        *_args("flag", None, "multi-node serving uses --nnodes / --node-rank", "headless", engine=False),
        *_args("value", one_of("1"), "ascq runs one API server process", "api_server_count", engine=False),
        *_args("value", None, "YAML config files are not supported; pass the flags", "config", engine=False),
        *_args("flag", None, "the gRPC server is not supported", "grpc", engine=False),
        *_args("values", None, LORA, "lora_modules", engine=False),
        *_args(
            "value",
            one_of("auto", "string"),
            "chat message content is rendered as a string",
            "chat_template_content_format",
            engine=False,
        ),
        *_args(
            "bool",
            is_false,
            "requests cannot bring their own chat template",
            "trust_request_chat_template",
            engine=False,
        ),
        *_args(
            "value",
            unset,
            "default chat template kwargs are not supported",
            "default_chat_template_kwargs",
            engine=False,
        ),
        *_args(
            "value", one_of("assistant"), "responses use the role 'assistant'", "response_role", engine=False
        ),
        *_args(
            "bool",
            is_false,
            "tool definitions are always rendered",
            "exclude_tools_when_tool_choice_none",
            engine=False,
        ),
        *_args("value", unset, "tool parser plugins are not supported", "tool_parser_plugin", engine=False),
        *_args(
            "value", unset, "tool servers (MCP / demo tools) are not supported", "tool_server", engine=False
        ),
        *_args("value", unset, "logging config files are not supported", "log_config_file", engine=False),
        *_args("value", any_value, NO_REQUEST_LOG, "max_log_len", engine=False),
        *_args(
            "bool",
            is_false,
            "per-request metrics in responses are not supported",
            "enable_per_request_metrics",
            engine=False,
        ),
        *_args(
            "bool",
            is_false,
            "the /load endpoint is not supported",
            "enable_server_load_tracking",
            engine=False,
        ),
        *_args(
            "bool",
            is_true,
            "/tokenizer_info is always served",
            "enable_tokenizer_info_endpoint",
            engine=False,
        ),
        *_args("bool", is_false, NO_REQUEST_LOG, "enable_log_outputs", engine=False),
        *_args("bool", any_value, NO_REQUEST_LOG, "enable_log_deltas", engine=False),
        *_args("bool", any_value, "ascq has no Cohere endpoints", "cohere_is_reasoning_model", engine=False),
        *_args("value", any_value, "ascq has no Cohere endpoints", "cohere_format", engine=False),
        *_args(
            "bool",
            is_false,
            "internal errors are answered with a 500 and not logged with a stack",
            "log_error_stack",
            engine=False,
        ),
        *_args("bool", is_false, "the tokens-only endpoint is not supported", "tokens_only", engine=False),
        *_args(
            "value",
            one_of("none"),
            "responses carry no system_fingerprint",
            "fingerprint_mode fingerprint_value",
            engine=False,
        ),
        *_args(
            "value",
            any_value,
            NO_DATA_PARALLEL,
            "data_parallel_supervisor_port dp_supervisor_probe_interval_s dp_supervisor_probe_timeout_s "
            "dp_supervisor_probe_failure_threshold",
            engine=False,
        ),
        *_args(
            "value", unset, "Unix domain sockets are not supported (use --host / --port)", "uds", engine=False
        ),
        *_args(
            "value",
            unset,
            "access-log filters are not supported",
            "disable_access_log_for_endpoints",
            engine=False,
        ),
        *_args("bool", is_false, "CORS is not supported", "allow_credentials", engine=False),
        *_args(
            "value",
            lambda v: unset(v) or _text(v) in ('["*"]', "*"),
            "CORS is not supported",
            "allowed_origins allowed_methods allowed_headers",
            engine=False,
        ),
        *_args(
            "value",
            unset,
            "TLS is not supported (terminate TLS in a reverse proxy)",
            "ssl_keyfile ssl_certfile ssl_ca_certs ssl_ciphers",
            engine=False,
        ),
        *_args(
            "value",
            one_of("0"),
            "TLS is not supported (terminate TLS in a reverse proxy)",
            "ssl_cert_reqs",
            engine=False,
        ),
        *_args(
            "bool",
            is_false,
            "TLS is not supported (terminate TLS in a reverse proxy)",
            "enable_ssl_refresh",
            engine=False,
        ),
        *_args("value", None, "custom ASGI middleware is not supported", "middleware", engine=False),
        *_args(
            "bool",
            is_false,
            "X-Request-Id response headers are not supported",
            "enable_request_id_headers",
            engine=False,
        ),
        *_args("bool", is_true, "ascq serves no API docs pages", "disable_fastapi_docs", engine=False),
        *_args("bool", is_false, "ascq serves no API docs pages", "enable_offline_docs", engine=False),
        *_args(
            "value",
            unset,
            "h11 limits keep uvicorn's defaults",
            "h11_max_incomplete_event_size h11_max_header_count",
            engine=False,
        ),
        *_args(
            "bool",
            any_value,
            "ascq has no late-interaction scoring",
            "enable_flash_late_interaction",
            engine=False,
        ),
    ]
}
# vLLM's name -> ascq's for the same setting
ENGINE_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}
# vLLM engine fields that ascq implements in the server only (`ascq serve` options): the values that mean
# "nothing" are accepted offline, others refused with the option to use
SERVER_ONLY = {
    "generation_config": ("--generation-config", one_of("vllm")),
    "override_generation_config": ("--override-generation-config", unset),
    "reasoning_parser": ("--reasoning-parser", unset),
}


def classify(name: str, value: Any, shown: str) -> str:
    """The log line for vLLM argument `name` when `value` changes nothing here; UnsupportedError otherwise.
    `shown`: the argument as the user gave it (`--flag value`, `EngineArgs(name=value)`)."""
    arg = VLLM_ARGS[name]
    if arg.accepts is None or not arg.accepts(value):
        raise UnsupportedError(f"{shown} is not supported: {arg.reason}")
    return f"{shown}: accepted, changes nothing here: {arg.reason}"


# ---- EngineArgs keywords --------------------------------------------------------------------------------


def closest_name(name: str, candidates: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def engine_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` for the dataclass `cls` with vLLM's names mapped to ascq's and harmless vLLM-only settings
    dropped (logged); anything else vLLM-only is UnsupportedError, an unknown name a one-line TypeError."""
    own = {f.name for f in fields(cls)}
    vllm = {name for name, arg in VLLM_ARGS.items() if arg.engine}
    kept = {}
    for name, value in kwargs.items():
        if name in own:
            kept[name] = value
        elif name in ENGINE_ALIASES:
            kept[ENGINE_ALIASES[name]] = value
        elif name in vllm:
            logger.info(classify(name, value, f"{cls.__name__}({name}={value!r})"))
        elif name in SERVER_ONLY:
            option, harmless = SERVER_ONLY[name]
            if not harmless(value):
                raise UnsupportedError(
                    f"{cls.__name__}({name}={value!r}) is not supported offline: ascq applies it in "
                    f"ascq serve {option}"
                )
        else:
            close = closest_name(name, own | vllm | set(ENGINE_ALIASES) | set(SERVER_ONLY))
            hint = f"; did you mean {close!r}?" if close else ""
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}{hint}")
    return kept


def vllm_keywords(cls: type) -> type:
    """Class decorator, after @dataclass: the constructor takes vLLM's keywords (see `engine_kwargs`)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **engine_kwargs(cls, kwargs))

    cls.__init__ = __init__
    return cls


# ---- `ascq serve` command line --------------------------------------------------------------------------


def _flag_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


SHORT_FLAGS = {
    "-asc": "api_server_count",
    "-dcp": "decode_context_parallel_size",
    "-dp": "data_parallel_size",
    "-dpn": "data_parallel_rank",
    "-dpr": "data_parallel_start_rank",
    "-dpl": "data_parallel_size_local",
    "-dpa": "data_parallel_address",
    "-dpp": "data_parallel_rpc_port",
    "-dpb": "data_parallel_backend",
    "-O": "compilation_config",
}


def _lookup(token: str) -> tuple[str, str, bool] | None:
    """(table name, flag as typed, bool value) for a vLLM flag in the table: `--x`, `--no-x`, `--x.key`,
    `-O3`."""
    flag = token.split("=", 1)[0]
    if flag in SHORT_FLAGS:
        return SHORT_FLAGS[flag], flag, True
    if flag.startswith("-O") and flag[2:].isdigit():
        return "compilation_config", flag, True
    if not flag.startswith("--"):
        return None
    name = _flag_name(flag.split(".", 1)[0].rstrip("+"))
    if name in VLLM_ARGS:
        return name, flag, True
    if name.startswith("no_") and VLLM_ARGS.get(name[3:], VllmArg("", "", None, "")).kind == "bool":
        return name[3:], flag, False
    return None


def split_vllm_flags(argv: list[str], declared: dict[str, bool]) -> tuple[list[str], list[str]]:
    """`ascq serve` arguments without vLLM's flags that the command does not declare, and a log line for each
    accepted one; a refused one raises UnsupportedError naming it. `declared`: the command's options ->
    whether each takes a value (so an option's value is never mistaken for a flag). vLLM's `--model X` becomes
    the MODEL argument."""
    kept: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag.replace("_", "-") in declared:  # vLLM: --max_num_seqs too
            token, flag = flag.replace("_", "-") + token[len(flag) :], flag.replace("_", "-")
        if flag in declared:
            kept.append(token)
            if declared[flag] and "=" not in token and i < len(argv):
                kept.append(argv[i])
                i += 1
            continue
        if flag == "--model":
            value, i = _one_value(token, argv, i)
            kept.append(value)
            continue
        found = _lookup(token)
        if found is None:
            kept.append(token)  # typer reports an unknown option / extra argument
            continue
        name, shown, bool_value = found
        kind = VLLM_ARGS[name].kind
        start = i
        if "=" in token:
            value: Any = token.split("=", 1)[1]
        elif kind in ("bool", "flag"):
            value = bool_value
        elif shown.startswith("-O") and shown != "-O":  # -O3
            value = shown[2:]
        elif kind == "values":
            while i < len(argv) and not argv[i].startswith("-"):
                i += 1
            value = " ".join(argv[start:i])
        elif kind == "optional" and (i >= len(argv) or argv[i].startswith("-")):
            value = True
        else:
            i += 1
            value = argv[start] if start < len(argv) else ""
        if kind not in ("bool", "flag") and value == "":
            raise AscqError(f"{shown} needs a value")
        typed = " ".join(argv[start - 1 : i])
        if "." in shown.lstrip("-"):  # --x.key value: one key of a JSON flag
            value = f"{{{shown.split('.', 1)[1].rstrip('+')}: {value}}}"
        notes.append(classify(name, value, typed))
    return kept, notes


def _one_value(token: str, argv: list[str], i: int) -> tuple[str, int]:
    if "=" in token:
        return token.split("=", 1)[1], i
    if i >= len(argv):
        raise AscqError(f"{token} needs a value")
    return argv[i], i + 1
