"""Runs inside vLLM's worker (via `worker_extension_cls`): loads new weights in place."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from groupflow.core.adapters import ADAPTER_ID
from groupflow.core.weight_format import Checksums, WorkerLoad, layer_of
from groupflow.rollout.expert_reload import expert_kernels_processed
from groupflow.rollout.routing_capture import capture_routing
from groupflow.rollout.shard_stream import ResidentPeak, ShardStream

# With tied embeddings vLLM's output projection shares the input embedding's weight.
TIED_HEAD = {"model.embed_tokens": "lm_head"}


class WeightReceiver:
    """Mixed into vLLM's worker class; reached with `llm.collective_rpc(name, args=...)`."""

    def start_routing_capture(self) -> None:
        """Capture the experts each token is routed to (rollout/routing_capture.py)."""
        self.routing_capture = capture_routing(self.model_runner)

    def take_routing(self, request_id: str, n: int):
        """The captured routing of a finished request's n samples."""
        return self.routing_capture.take(request_id, n)

    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load (name, tensor) pairs in place, in one pass over `named_tensors`, which may be an
        iterator that yields them as they arrive."""
        # reload_weights maps Hugging Face names onto vLLM's fused layers (qkv, gate_up),
        # the same path as loading a checkpoint, so no name mapping lives here. It processes
        # a layer as soon as all its tensors are in, and the rest once at the end: one call
        # per sync (a call per bucket would pay that whole-model pass per bucket).
        layers: set[str] = set()

        def noting_layers():
            for name, tensor in named_tensors:
                layers.add(layer_of(name))
                yield name, tensor

        try:
            with expert_kernels_processed(self.model_runner.get_model()):
                self.model_runner.reload_weights(weights_iterator=noting_layers())
        except BaseException:
            # vLLM moves every layer's weights aside for a reload and puts them back only at
            # its end. Put back those of the layers not loaded, so that the engine still
            # samples: with the old weights there and the new ones in the layers loaded,
            # until a later load (a learner rebuilt after a failed sync syncs every engine).
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            model_runner = self.model_runner
            finalize_layerwise_reload(model_runner.get_model(), model_runner.model_config)
            raise
        finally:
            self._repack_kept_cpu_weights(layers | {TIED_HEAD.get(x, x) for x in layers})
        return len(layers)

    def load_shards(self, address: str) -> tuple[WorkerLoad, Checksums]:
        """Load a sync's parts for this tensor-parallel worker, read from the engine's socket
        at `address` as vLLM consumes them (rollout/shard_stream.py). Returns what it received
        and held, and the checksum of each part it received."""
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
        with ResidentPeak() as held, ShardStream(address, rank) as stream:
            self.load_named_tensors(stream.pairs())
        return WorkerLoad(rank, stream.bytes, held.extra), stream.received

    def load_adapter(self, named_tensors: list[tuple[str, torch.Tensor]], config: dict) -> int:
        """Serve the LoRA adapter `named_tensors` (PEFT's names, groupflow/core/adapters.py) with
        PEFT config `config` in place of the one served so far, under the one adapter id;
        running requests take it from their next token. Returns the modules adapted.

        vLLM (0.32) loads adapters from files only; this is its own load with the files'
        reads replaced by the tensors at hand, into the worker's adapter manager."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager
        adapters = manager._adapter_manager
        helper = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
        )
        helper.validate_legal(manager.lora_config)
        mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
        adapter = LoRAModel.from_lora_tensors(
            lora_model_id=ADAPTER_ID,
            # vLLM scales lora_B in place while it prepares the adapter: its own copies.
            tensors={name: tensor.detach().clone() for name, tensor in named_tensors},
            peft_helper=helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None),
        )
        # A module name vLLM does not know would be dropped without a word, and the engine
        # would serve the base model in its place.
        known = set(adapters.modules) | {m for ms in adapters.packed_modules.values() for m in ms}
        unknown = sorted(set(adapter.loras) - known)
        if unknown:
            raise ValueError(f"LoRA adapter: modules not in the engine's model: {unknown[:3]}")
        adapters.remove_adapter(ADAPTER_ID)
        adapters.add_adapter(adapter)
        adapters.activate_adapter(ADAPTER_ID)
        adapters.pin_adapter(ADAPTER_ID)  # never evicted: its path is not a file to reload
        return len(adapter.loras)

    def _repack_kept_cpu_weights(self, layers: set[str]) -> None:
        """On CPU, the output projection keeps its weight *and* a packed copy for the GEMM
        kernel; the in-place reload updates the weight but not the packed copy (vLLM 0.32),
        so the engine would keep sampling from the old head. Repack it from the new weight,
        in the layers just loaded."""
        model = self.model_runner.get_model()
        for name, module in model.named_modules():
            if not any(name == x or name.startswith(x + ".") for x in layers):
                continue
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0:
                from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

                dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    def named_parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the weights the engine computes with, in vLLM's layout (for sync checks).

        On CPU, vLLM repacks linear weights (and the output projection) into oneDNN/SGL
        kernels, often leaving an empty parameter behind; such a weight is read back by
        applying the packed kernel to an identity matrix, which reproduces every element
        exactly (one non-zero per sum).
        """
        model = self.model_runner.get_model()
        out = {}
        for module_name, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                key = f"{module_name}.{name}" if module_name else name
                if name == "weight" and hasattr(module, "cpu_linear"):
                    width = param.shape[1] if param.numel() else module.input_size_per_partition
                    eye = torch.eye(width, dtype=param.dtype)
                    out[key] = module.cpu_linear(eye, param, None).T.contiguous()
                else:
                    out[key] = param.detach().cpu().clone()
        return out
