"""The shard's gRPC server: converts protobuf to internal types, calls the ModelRunner, converts back.

Run:  python -m rill.shard.server --model-id PATH --socket /tmp/rill-shard-0.sock [--device cpu]
      [--dtype float32] [--kv-cache-dtype int8] [--max-loras N [--max-lora-rank R]]
      (tensor parallelism: one process per rank, each with --rank R --world-size N --dist-init-method URL;
      the launcher's --num-shard N does this)
The model is loaded, warmed up and run, and LoRA adapters are read, on one thread of its own (`ModelThread`),
one call at a time, so the event loop keeps answering Health. A ValueError from the runner (bad input) becomes
INVALID_ARGUMENT with its message; the server then carries on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch

from rill.shard import distributed
from rill.shard.batch import BlockCopy, ForwardRequest, Generation, SequenceChunk
from rill.shard.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZE_TYPES,
    QUANTIZED_ACTIVATIONS,
    ShardConfig,
)
from rill.shard.memory import CGROUP_ROOT, return_large_frees
from rill.shard.pb.shard.v1 import shard_pb2, shard_pb2_grpc
from rill.shard.runner import LoraOffError, ModelRunner, NotReadyError
from rill.shard.sampling import SamplingParams

if TYPE_CHECKING:
    from rill.shard.telemetry import ForwardTracer

logger = logging.getLogger("rill.shard.server")

T = TypeVar("T")


def sampling_params_from_pb(params: shard_pb2.SamplingParams) -> SamplingParams:
    """Unset proto fields are 0; `SamplingParams` reads 0 as off for repetition_penalty and typical_p."""
    return SamplingParams(
        do_sample=params.do_sample,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        logit_bias=dict(params.logit_bias),
        min_p=params.min_p,
        typical_p=params.typical_p,
        top_n_logprobs=params.top_n_logprobs,
        num_prompt_tokens=params.num_prompt_tokens,
        min_new_tokens=params.min_new_tokens,
        stop_token_ids=tuple(params.stop_token_ids),
    )


def forward_request_from_pb(request: shard_pb2.ForwardRequest) -> ForwardRequest:
    return ForwardRequest(
        released_ids=list(request.released_ids),
        sequences=[
            SequenceChunk(
                id=seq.id,
                token_ids=list(seq.token_ids),
                num_computed_tokens=seq.num_computed_tokens,
                block_table=list(seq.block_table),
                sample=seq.sample,
                params=sampling_params_from_pb(seq.params) if seq.HasField("params") else None,
                cached_token_ids=list(seq.cached_token_ids),
                allowed_token_bitmask=list(seq.allowed_token_bitmask),
                adapter_id=seq.adapter_id,
                num_speculative_tokens=seq.num_speculative_tokens,
            )
            for seq in request.sequences
        ],
        swap_out=[BlockCopy(c.device_block, c.host_block) for c in request.swap_out],
        swap_in=[BlockCopy(c.device_block, c.host_block) for c in request.swap_in],
        unloaded_adapter_ids=list(request.unloaded_adapter_ids),
    )


def generation_to_pb(generation: Generation) -> shard_pb2.Generation:
    return shard_pb2.Generation(
        id=generation.id,
        token_id=generation.token_id,
        logprob=generation.logprob,
        top_logprobs=[
            shard_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in generation.top_logprobs
        ],
    )


class ModelThread:
    """The one thread that touches the model: loading, warmup and every forward. OpenMP (libgomp) keeps a team
    of worker threads for each thread that starts parallel regions; a second team (say, the model loaded on
    the main thread and run on a pool thread) puts more threads than CPUs under its management, and libgomp
    then stops spinning at the end of a region, so each of a step's few hundred regions pays a futex wake.
    Measured on 2 CPUs with the launcher's spin count: a bfloat16 decode step of 16 sequences at context 512,
    25 ms with two teams against 21 ms with one."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rill-model")

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)


class ShardServicer(shard_pb2_grpc.ShardServicer):
    def __init__(
        self, runner: ModelRunner, model_thread: ModelThread, tracer: ForwardTracer | None = None
    ) -> None:
        self.runner = runner
        self.model_thread = model_thread
        self.tracer = tracer  # records a `forward` span per call with --otlp-endpoint
        self.lock = asyncio.Lock()  # one runner call at a time

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
        async with self.lock:
            try:
                return await self.model_thread.run(fn)
            except ValueError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            except (NotReadyError, LoraOffError) as error:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
            except Exception:
                # A shard bug or device failure: log the traceback here, tell the router only that it failed.
                logger.exception("forward call failed")
                await context.abort(grpc.StatusCode.INTERNAL, "shard internal error (see shard log)")
        raise AssertionError("unreachable: context.abort raises")

    async def Info(
        self, request: shard_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.InfoResponse:
        runner = self.runner
        return shard_pb2.InfoResponse(
            model_type=runner.model_type,
            dtype=runner.config.dtype,
            device=runner.device.type,
            block_size=runner.config.block_size,
            vocab_size=runner.vocab_size,
            eos_token_ids=runner.eos_token_ids,
            max_position_embeddings=runner.max_position_embeddings,
            world_size=runner.config.world_size,
            architecture=type(runner.model).__name__,
            sliding_windows=list(runner.model_config.layer_windows),
            max_loras=runner.config.max_loras,
            max_lora_rank=runner.config.max_lora_rank,
        )

    async def Health(
        self, request: shard_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.HealthResponse:
        # Not on the model thread: Health answers while a forward holds it (a one-element op, no OpenMP team).
        warmed_up = await asyncio.to_thread(self.runner.health)
        return shard_pb2.HealthResponse(warmed_up=warmed_up)

    async def Warmup(
        self, request: shard_pb2.WarmupRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.WarmupResponse:
        result = await self._call(
            context,
            lambda: self.runner.warmup(
                request.max_batch_tokens,
                request.max_batch_size,
                request.max_total_kv_tokens,
                request.swap_space_bytes if request.HasField("swap_space_bytes") else None,
                request.max_speculative_tokens,
            ),
        )
        return shard_pb2.WarmupResponse(
            num_blocks=result.num_blocks,
            num_host_blocks=result.num_host_blocks,
            swap_seconds_per_block=result.swap_seconds_per_block,
            prefill_seconds_per_token=result.prefill_seconds_per_token,
            bytes_per_block=result.bytes_per_block,
            kv_pool_reason=result.kv_pool_reason,
            swap_pool_reason=result.swap_pool_reason,
        )

    async def _forward(
        self, request: shard_pb2.ForwardRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.ForwardResponse:
        forward_request = forward_request_from_pb(request)
        result = await self._call(context, lambda: self.runner.forward(forward_request))
        return shard_pb2.ForwardResponse(
            generations=[generation_to_pb(g) for g in result.generations],
            forward_time_us=int(result.model_seconds * 1e6),
        )

    async def _traced_forward(
        self, method: str, request: shard_pb2.ForwardRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.ForwardResponse:
        """`_forward`, inside a `forward` span (a child of the router's step span) when tracing."""
        if self.tracer is None:
            return await self._forward(request, context)
        with self.tracer.forward_span(method, context.invocation_metadata()) as span:
            span.set_attribute("rill.sequences", len(request.sequences))
            span.set_attribute("rill.tokens", sum(len(seq.token_ids) for seq in request.sequences))
            response = await self._forward(request, context)
            span.set_attribute("rill.forward_time_us", response.forward_time_us)
            return response

    async def Prefill(
        self, request: shard_pb2.ForwardRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.ForwardResponse:
        return await self._traced_forward("Prefill", request, context)

    async def Decode(
        self, request: shard_pb2.ForwardRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.ForwardResponse:
        if any(len(seq.token_ids) != 1 for seq in request.sequences):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "Decode: every sequence must carry exactly one token"
            )
        return await self._traced_forward("Decode", request, context)

    async def LoadAdapter(
        self, request: shard_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.LoadAdapterResponse:
        # On the model thread like a forward (between two of them), so reading never races a slot copy.
        adapter = await self._call(
            context, lambda: self.runner.load_adapter(request.adapter_id, Path(request.path))
        )
        return shard_pb2.LoadAdapterResponse(rank=adapter.rank, target_modules=adapter.target_modules)

    async def ClearCache(
        self, request: shard_pb2.ClearCacheRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.ClearCacheResponse:
        async with self.lock:
            self.runner.clear()
        return shard_pb2.ClearCacheResponse()


async def serve(config: ShardConfig) -> None:
    model_thread = ModelThread()
    try:
        runner = await model_thread.run(lambda: ModelRunner(config))
    except ValueError as error:  # a model this configuration cannot serve (e.g. heads not divisible by N)
        logger.error(
            "rank %d/%d cannot load %s: %s", config.rank, config.world_size, config.model_path, error
        )
        raise SystemExit(2) from None
    tracer = None
    if config.otlp_endpoint:
        try:
            from rill.shard.telemetry import ForwardTracer
        except ImportError as error:
            logger.error("--otlp-endpoint needs the `tracing` extra (pip install 'rill[tracing]'): %s", error)
            raise SystemExit(2) from None
        tracer = ForwardTracer(config.otlp_endpoint, config.rank, config.world_size)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 256 * 2**20),
            ("grpc.max_send_message_length", 256 * 2**20),
        ]
    )
    shard_pb2_grpc.add_ShardServicer_to_server(ShardServicer(runner, model_thread, tracer), server)
    config.socket_path.unlink(missing_ok=True)
    server.add_insecure_port(f"unix://{config.socket_path}")
    await server.start()
    logger.info("rank %d/%d serving on unix://%s", config.rank, config.world_size, config.socket_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down")
    await server.stop(grace=2.0)
    config.socket_path.unlink(missing_ok=True)
    distributed.shutdown()
    if tracer is not None:
        tracer.shutdown()  # exports the spans still buffered


def parse_args(argv: list[str] | None = None) -> ShardConfig:
    parser = argparse.ArgumentParser(
        prog="python -m rill.shard.server",
        description="Rill model shard: loads a Hugging Face model folder and serves forward passes over gRPC "
        "on a unix socket for the Rill router.",
    )
    parser.add_argument(
        "--model-id",
        required=True,
        type=Path,
        help="model folder with config.json and *.safetensors (Hugging Face layout)",
    )
    parser.add_argument("--socket", required=True, type=Path, help="unix socket path to listen on")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="device to run on (default: cpu)")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="dtype of weights and KV cache (default: float32)",
    )
    parser.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="what the KV cache stores: auto = --dtype; int8 = K/V rows quantized, one float32 scale per "
        "token and KV head (about 2x the blocks of bfloat16, 3.8x of float32; CPU only) (default: auto)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_TYPES,
        default=None,
        help="quantize float weights at load: the decoder layers' projections to this type, the embedding "
        "and "
        "LM head to q8_0 (cpu, one shard)",
    )
    parser.add_argument(
        "--quantized-activations",
        choices=QUANTIZED_ACTIVATIONS,
        default="int16",
        help="what quantized weights multiply on the cpu: int16 activations quantized per token (finer than "
        "bfloat16, close to float32; default), int8 ones (llama.cpp's way: fastest, less exact) or float32 "
        "(exact)",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="torch intra-op threads on the CPU; 0 keeps torch's default",
    )
    parser.add_argument("--rank", type=int, default=0, help="this shard's tensor-parallel rank (default: 0)")
    parser.add_argument("--world-size", type=int, default=1, help="tensor-parallel ranks (default: 1)")
    parser.add_argument(
        "--dist-init-method",
        default=None,
        help="torch.distributed rendezvous URL shared by every rank (tcp://HOST:PORT or file:///PATH); "
        "required when --world-size > 1",
    )
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="Rill's native kernels (cpu: C++, cuda: Triton) or the torch references (torch) for "
        "attention, KV writes, norms and rotary; auto: the device's kernels where they can run, else torch "
        "(default: auto)",
    )
    parser.add_argument(
        "--cuda-graph-max-batch-size",
        type=int,
        default=256,
        help="capture CUDA graphs of decode steps up to this many sequences; 0 = off (default: 256)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="send OpenTelemetry spans over OTLP/HTTP to this collector (spans go to URL/v1/traces); "
        "needs the `tracing` extra",
    )
    parser.add_argument(
        "--cgroup-root",
        type=Path,
        default=CGROUP_ROOT,
        help=f"where cgroups are mounted; their memory limits bound the pools (default: {CGROUP_ROOT})",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=0,
        help="LoRA adapter slots on the device: the most distinct adapters one forward may use; 0 = LoRA off "
        "(default: 0)",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="the largest LoRA adapter rank the slots hold (default: 16)",
    )
    args = parser.parse_args(argv)
    try:
        config = ShardConfig(
            model_path=args.model_id,
            socket_path=args.socket,
            device=args.device,
            dtype=args.dtype,
            block_size=args.kv_block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            rank=args.rank,
            world_size=args.world_size,
            num_threads=args.num_threads,
            dist_init_method=args.dist_init_method,
            attention_backend=args.attention_backend,
            cuda_graph_max_batch_size=args.cuda_graph_max_batch_size,
            otlp_endpoint=args.otlp_endpoint,
            cgroup_root=args.cgroup_root,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            quantize=args.quantize,
            quantized_activations=args.quantized_activations,
        )
    except ValueError as error:
        parser.error(str(error))
    return config


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_args(argv)
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    if config.device == "cpu" and not return_large_frees():
        logger.info("no glibc mallopt: freed activations may stay resident")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
