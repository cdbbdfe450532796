"""A vLLM worker extension that swaps a served model's weights in place.

vLLM mixes the class named by ``--worker-extension-cls`` into its worker class,
so the methods below run inside every vLLM worker process with ``self`` the
vLLM worker (``self.model_runner.model`` is the ``nn.Module`` being served).
They are reached over HTTP with the dev-mode endpoint (server started with
``VLLM_SERVER_DEV_MODE=1``)::

    POST /collective_rpc {"method": "astraflow_pull",
                          "args": [store_uri, run, policy, version, sha256]}
      -> {"results": ["<sha256 of the loaded version>", ...]}   # one entry per worker

(the endpoint passes string arguments only and returns non-JSON results as
``str``), or in process with ``LLM.collective_rpc("astraflow_pull", args=(...))``.
``tests/producers/test_vllm_engine.py`` runs the whole round trip on the CPU backend.

``astraflow_pull`` is how a run updates the server: the worker itself brings
its weights to a version from AstraFlow's weight store with the same
:class:`weights.puller.Puller` (and planner: delta chain or full snapshot,
every step verified by checksum) that RaaS workers use, keeps the verified
host copy in checkpoint layout, and hands vLLM only the layers whose tensors
changed since the last update, from memory: no file per version.

This module imports torch, safetensors, vLLM and AstraFlow's ``weights``
package only inside the methods, so it loads in the vLLM venv (``.venv-vllm``,
``scripts/install_vllm.sh``, which carries the store and codec dependencies)
and importing it anywhere else costs nothing. vLLM refuses an extension whose
attribute names clash with the worker's, so the class defines only ``astraflow_``
methods; helpers and state are module-level.

Loading goes through the model runner's ``reload_weights(weights_iterator=...,
is_checkpoint_format=True)`` (vLLM 0.32's CPU and GPU runners have it; older ones
get ``model.load_weights``): each layer is put back into checkpoint layout,
loaded, then re-processed. A bare ``model.load_weights`` fails on the CPU backend,
whose linear layers repack their weights for oneDNN after loading and leave an
empty ``weight`` parameter ("Attempted to load weight (torch.Size([128, 256])) into
parameter (torch.Size([0]))"). The layerwise path needs each vLLM layer given
whole, every checkpoint tensor that feeds it (``qkv_proj``: q, k, v and their
biases; ``gate_up_proj``: gate and up): a layer given in part is rebuilt with the
missing part uninitialised, silently. :func:`whole_layers` sees to that. (For the
same reason the served linear weights cannot be read back on the CPU backend:
the checksum an update returns is that of the verified host copy it loaded from.)
"""
from __future__ import annotations

import re
from typing import Any

#: A decoder layer's sub-block (``model.layers.3.self_attn``, ``model.layers.3.mlp``): vLLM fuses the
#: projections inside one (``qkv_proj``, ``gate_up_proj``), so an update hands over the whole sub-block.
_SUB_BLOCK = re.compile(r"^(.*\.layers\.\d+\.[^.]+)\.")
#: (store URI, run, policy) -> the Puller holding this worker's verified host copy of that policy.
_PULLERS: dict[tuple[str, str, str], Any] = {}


def whole_layers(changed: set[str] | None, names: list[str]) -> list[str]:
    """The checkpoint tensor names to hand vLLM so that every layer holding a ``changed`` tensor is given
    whole (module docstring): for a tensor inside a decoder layer's sub-block (attention,
    MLP), every tensor of that sub-block; other tensors alone. ``changed`` None: all ``names``.
    Returns names in the order of ``names``."""
    if changed is None:
        return list(names)
    prefixes = {m.group(1) + "." for n in changed if (m := _SUB_BLOCK.match(n))}
    return [n for n in names if n in changed or any(n.startswith(p) for p in prefixes)]



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

    def astraflow_pull(self, store_uri: str, run: str, policy: str, version: str, sha256: str) -> str:
        """Bring the served model to ``version`` of ``policy`` from AstraFlow's weight store, in place.

        The first call pulls a full snapshot into a host copy (float tensors in checkpoint layout, the
        published dtype); later calls apply the cheapest verified chain of deltas (or a snapshot) to that
        copy, as :meth:`weights.puller.Puller.sync` does for a RaaS worker. Then only the decoder
        sub-blocks and other tensors that changed (:func:`whole_layers`) are streamed from the host copy
        into vLLM through the runner's ``reload_weights`` (module docstring). Requests in
        flight meanwhile may see a mix: callers wait for their batch first, and reset the prefix cache.

        Args:
            store_uri: the store root (``file:///...`` or ``s3://...``; S3 credentials from the
                server's environment).
            run, policy: whose weights.
            version: the target version (a decimal string: collective_rpc passes strings).
            sha256: the announcement's checksum (:func:`weights.codec.state_sha256`) the result must have; empty:
                none is known (offline evaluation), the objects' own checks stand.

        Returns:
            The checksum of the host copy now loaded, verified equal to ``sha256``; or, when the version
            could not be loaded, ``"error: <type>: <message>"``. It never raises: vLLM shuts the whole
            server down when a worker's RPC raises. A version that was not reached (no verified chain, a
            checksum that differs) leaves the served weights as they were; a failure while handing
            tensors to vLLM drops the host copy, so the next call loads a whole snapshot again.
        """
        key = (store_uri, run, policy)
        try:
            return self._astraflow_pull(key, int(version), sha256)
        except Exception as e:  # noqa: BLE001  (reported to the client; raising would stop the server)
            return f"error: {type(e).__name__}: {e}"

    def _astraflow_pull(self, key: tuple[str, str, str], version: int, sha256: str) -> str:
        from topics.names import TopicNames
        from weights.puller import Puller
        from weights.store import WeightStore

        store_uri, run, policy = key
        puller = _PULLERS.get(key)
        if puller is None:
            puller = _PULLERS[key] = Puller(WeightStore(store_uri, run), None, TopicNames(run), policy)

        def hand_over(state: dict, _version: int) -> None:
            names = whole_layers(puller.changed, sorted(state))
            weights = ((n, state[n]) for n in names)
            runner = self.model_runner
            _served_model(self)
            try:
                if hasattr(runner, "reload_weights"):
                    runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
                else:
                    runner.model.load_weights(weights=weights)
            except Exception:
                del _PULLERS[key]  # vLLM may hold part of it: start over from a snapshot next time
                raise

        puller.on_update = hand_over
        puller.sync(version, expect_sha256=sha256 or None)
        if puller.version != version or (sha256 and puller.sha256 != sha256):
            raise RuntimeError(f"astraflow_pull: policy {policy!r} is at version {puller.version} "
                               f"(sha256 {puller.sha256}), not {version} ({sha256})")
        return puller.sha256
