"""Runs inside vLLM's worker (via `worker_extension_cls`): loads new weights in place."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from groupflow.weight_format import layer_of

# With tied embeddings vLLM's output projection shares the input embedding's weight.
TIED_HEAD = {"model.embed_tokens": "lm_head"}


class WeightReceiver:
    """Mixed into vLLM's worker class; reached with `llm.collective_rpc(name, args=...)`."""

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
