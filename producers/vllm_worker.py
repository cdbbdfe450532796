"""A vLLM worker extension that swaps a served model's weights in place.

vLLM mixes the class named by ``--worker-extension-cls`` into its worker class,
so the methods below run inside every vLLM worker process with ``self`` the
vLLM worker (``self.model_runner.model`` is the ``nn.Module`` being served).
They are reached over HTTP with the dev-mode endpoint (server started with
``VLLM_SERVER_DEV_MODE=1``)::

    POST /collective_rpc {"method": "load_safetensors", "args": ["/path/w.safetensors"]}
      -> {"results": ["<tensor count>", ...]}          # one entry per worker
    POST /collective_rpc {"method": "weights_checksum"}
      -> {"results": ["<sha256 hex>", ...]}

(the endpoint passes string arguments only and returns non-JSON results as
``str``), or in process with ``LLM.collective_rpc("load_safetensors", args=(path,))``.
``scripts/vllm_smoke.py`` shows the whole round trip on the CPU backend.

Self-contained on purpose: this module imports torch, safetensors and vLLM only
inside the methods and imports nothing else from AstraFlow, so it loads in the
vLLM venv (``.venv-vllm``, ``scripts/install_vllm.sh``) and importing it
anywhere else costs nothing. vLLM refuses an extension whose attribute names
clash with the worker's, so the class defines only the two public methods;
helpers are module-level functions.
"""
from __future__ import annotations

import os

__all__ = ["AstraflowWorkerExtension"]


def _served_model(worker):
    """The worker's ``nn.Module``: ``model_runner.get_model()`` where the runner has it (CPU and
    GPU runners of vLLM 0.32 do), else ``model_runner.model``.

    Raises:
        RuntimeError: the worker has no model runner or the model is not loaded yet.
    """
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise RuntimeError(f"{type(worker).__name__} has no model_runner: not a vLLM model worker")
    model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
    if model is None:
        raise RuntimeError("the vLLM worker has not loaded its model yet")
    return model


class AstraflowWorkerExtension:
    """Mixed into vLLM's worker (``--worker-extension-cls producers.vllm_worker.AstraflowWorkerExtension``).

    Not meant to be instantiated on its own: ``self`` is a vLLM worker
    (``vllm.v1.worker.cpu_worker.CPUWorker`` on the CPU backend, ``gpu_worker.Worker``
    on GPUs). Weight updates are not synchronised with generation: pause or drain
    requests first if a request must see one set of weights, and reset the prefix
    cache (``POST /reset_prefix_cache``) afterwards, or prompts whose KV blocks
    were cached under the old weights reuse them.
    """

    def load_safetensors(self, path: str) -> int:
        """Load the tensors of a safetensors file into the served model, in place.

        The file holds checkpoint-format tensors: Hugging Face names and shapes
        (``model.layers.0.self_attn.q_proj.weight``: float[num_heads*head_dim, hidden]),
        any float dtype (cast to the parameter's dtype by vLLM's loaders); they are
        read on CPU one at a time and handed to vLLM as an iterator of
        ``(name, tensor)``. A subset of the model is allowed, with a caveat below.

        Where the model runner has ``reload_weights`` (vLLM 0.32's CPU and GPU runners do)
        the tensors go through ``model_runner.reload_weights(weights_iterator=...,
        is_checkpoint_format=True)``, which calls ``model.load_weights(weights)`` with
        vLLM's layerwise reload around it: each layer is put back into checkpoint
        layout, loaded, then re-processed (``process_weights_after_loading``). That
        is required on the CPU backend, whose linear layers repack their weights for
        oneDNN / AMX kernels after loading and leave an empty ``weight`` parameter
        (``qkv_proj.weight``: float32[0]), so there a bare ``model.load_weights`` fails
        ("Attempted to load weight (torch.Size([128, 256])) into parameter
        (torch.Size([0]))") after loading the tensors that came before.

        Caveat of the layerwise path: a vLLM layer must be given whole, every
        checkpoint tensor that feeds it (``qkv_proj``: the q, k and v weights and,
        for Qwen2, their biases; ``gate_up_proj``: gate and up). Layers absent from
        the file keep their weights (vLLM logs "Failed to load weights" for each); a
        layer given in part is rebuilt with the missing part left as uninitialised
        memory (``torch.empty_strided``), silently. Older runners without
        ``reload_weights`` get ``model_runner.model.load_weights(weights=...)``.

        Args:
            path: the ``.safetensors`` file, readable by the worker process (same
                machine or a shared filesystem).

        Returns:
            the number of tensors read from the file and handed to vLLM.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file holds no tensors.
            RuntimeError: the worker has no loaded model (see ``_served_model``).
            Exception: whatever vLLM's loaders raise for a name the model does not
                have (usually ``KeyError``) or a shape that does not fit (``AssertionError``);
                tensors before the bad one may already be loaded.
        """
        from safetensors import safe_open

        if not os.path.isfile(path):
            raise FileNotFoundError(f"load_safetensors: no file {path!r}")
        model = _served_model(self)
        count = 0
        with safe_open(path, framework="pt", device="cpu") as handle:
            names = list(handle.keys())
            if not names:
                raise ValueError(f"load_safetensors: {path!r} holds no tensors")

            def weights():
                nonlocal count
                for name in names:
                    count += 1
                    yield name, handle.get_tensor(name)

            runner = self.model_runner
            if hasattr(runner, "reload_weights"):
                runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
            else:
                model.load_weights(weights=weights())
        return count

    def weights_checksum(self) -> str:
        """A sha256 hex digest of the served model's parameters, as this worker holds them.

        Recipe: ``h = hashlib.sha256()``; for each ``(name, p)`` of
        ``model.named_parameters()`` sorted by name:
        ``h.update(f"{name}|{dtype}|{shape}\\n".encode())`` with ``dtype`` as
        ``str(p.dtype)`` (``torch.float32``) and ``shape`` as ``",".join(map(str, p.shape))``,
        then ``h.update(<p's bytes>)``, the bytes being
        ``p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()``
        (native little-endian; works for bfloat16 too). Returns ``h.hexdigest()``.

        It fingerprints vLLM's layout, not the checkpoint's: fused parameters
        (``qkv_proj``, ``gate_up_proj``), padded vocabularies, tied embeddings once,
        and with tensor parallelism this worker's shard only (collective_rpc returns
        one digest per worker). Equal digests across workers of the same layout, or
        before and after loading the same file, mean equal weights. On the CPU
        backend the linear layers' ``weight`` parameters are empty (their values
        live in prepacked oneDNN / AMX buffers that torch cannot read back), so there
        the digest covers embeddings, norms, biases and the names/shapes of the
        rest: it changes when any of those change, but does not see a change
        confined to linear weights; compare outputs (logprobs) for those.

        Raises:
            RuntimeError: the worker has no loaded model.
        """
        import hashlib

        import torch

        model = _served_model(self)
        digest = hashlib.sha256()
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            shape = ",".join(map(str, param.shape))
            digest.update(f"{name}|{param.dtype}|{shape}\n".encode())
            data = param.detach().cpu().contiguous().view(-1)
            digest.update(data.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
