"""``DumpTensors``: save chosen GEMM tensors with ``torch.save``, as Transformer Engine's feature does, to
``{log_dir}/tensor_dumps/rank_{rank}/iter_{iteration:06d}/{layer}_{tensor}.pt`` (``dump_file_name``).

A file holds a dict: ``high_precision`` (the tensor before quantization) and ``quantized`` (the operand
the GEMMs read, as a dict of plain tensors with its format name). Unlike TE's pickled quantized tensor,
everything in it is a torch tensor, string, int or tuple, so ``torch.load(path)`` (``weights_only``
included) needs neither lowprec nor its version.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from typing import Any

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import TEConfigAPIMapper
from lowprec.debug.features.log_tensor_stats import schedule
from lowprec.quant.protocol import BlockScaledData, BlockScaledTensor, Float8Tensor, QuantizedTensor
from nvdlfw_inspect.debug_features.log_tensor_stats import WINDOW_KEYS, validate_window
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector, UnsafeLogPathError
from nvdlfw_inspect.files import replace_whole
from nvdlfw_inspect.logging import get_logger, link_out_of, say_once
from nvdlfw_inspect.registry import Registry, api_method
from nvdlfw_inspect.utils import get_distributed_rank

DUMP_KEYS = ("high_precision_tensor", "quantized_tensor")
MAX_NAME_BYTES = 160  # with the hash and a temporary file's additions, well under the 255 bytes of a file name
_TE_REPLACED = re.compile(r'[/\\:*?"<>| .]')  # what Transformer Engine's DumpTensors replaces with "_"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # a NUL would cut the name, a newline break a listing


def dump_file_name(layer_name: str, tensor_name: str, clash: bool = False) -> str:
    """Transformer Engine's name, ``{layer}_{tensor}.pt`` with ``/ \\ : * ? " < > |``, space and ``.`` replaced by
    ``_``, so tools written for TE's dumps find them. A name that needs more (control characters, more than
    ``MAX_NAME_BYTES``) or that ``clash``es with another tensor's name in the same iteration (``model.fc1`` and
    ``model_fc1``) also has its control characters replaced, is cut, and gets ``.{hash}`` of the full names: TE's
    names never hold a ``.``, so it never meets one of them."""
    te_name = _TE_REPLACED.sub("_", f"{layer_name}_{tensor_name}")
    safe = _CONTROL.sub("_", te_name)
    if clash or safe != te_name or len(safe.encode()) > MAX_NAME_BYTES:
        cut = safe.encode()[:MAX_NAME_BYTES].decode("utf-8", "ignore")
        safe = cut + "." + hashlib.sha256(json.dumps([layer_name, tensor_name]).encode()).hexdigest()[:12]
    return f"{safe}.pt"


def dump_path(root_log_dir: str, rank: int, iteration: int, layer_name: str, tensor_name: str, clash: bool = False) -> str:
    """Where one tensor goes (see ``dump_file_name``)."""
    directory = os.path.join(root_log_dir, "tensor_dumps", f"rank_{rank}", f"iter_{iteration:06d}")
    return os.path.join(directory, dump_file_name(layer_name, tensor_name, clash))


def write_whole(dump: dict[str, Any], path: str, root_log_dir: str) -> None:
    """``torch.save`` into memory, then the bytes through ``replace_whole``: the dump is there whole or not at all
    (a full disk leaves no unreadable file), and a link planted at ``path`` is replaced, not followed. A failed
    write is an ``OSError``: written to a file, ``torch.save`` reports it as a ``RuntimeError`` ("unexpected pos")
    when its zip writer goes on after the failure. A directory on the way that links out of ``log_dir`` is
    refused (``UnsafeLogPathError``)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    link = link_out_of(root_log_dir, directory)
    if link is not None:
        raise UnsafeLogPathError(f"the symbolic link {link} leads out of log_dir ({root_log_dir}); remove it")
    serialized = io.BytesIO()
    torch.save(dump, serialized)
    replace_whole(path, lambda file: file.write(serialized.getbuffer()))


def _block_part(part: BlockScaledData) -> dict[str, Any]:
    out = {"data": part.data.clone(), "scales": part.scales.clone(), "block": part.layout.block, "shape": part.layout.shape}
    if part.tensor_scale_inv is not None:
        out["tensor_scale_inv"] = part.tensor_scale_inv.clone()
    if part.layout.hadamard_seed is not None:
        out["hadamard_seed"] = part.layout.hadamard_seed
    return out


def plain_quantized(operand: Float8Tensor | BlockScaledTensor) -> dict[str, Any]:
    """A quantized operand as plain tensors. FP8 per tensor: ``data`` (a torch float8 tensor) times
    ``scale_inv``. Block formats: ``rowwise`` and ``columnwise`` (the transpose, blocked along its rows),
    each with padded ``data`` (FP8, or E2M1 codes: bit 3 the sign, bits 0-2 the index into 0, 0.5, 1,
    1.5, 2, 3, 4, 6), one of ``scales`` per ``block`` (height, width) and NVFP4's ``tensor_scale_inv``."""
    if isinstance(operand, Float8Tensor):
        return {"format": operand.format.name, "data": operand.data.clone(), "scale_inv": operand.scale_inv.clone()}
    element = (operand.rowwise or operand.columnwise).layout.element.name
    out: dict[str, Any] = {"format": f"block_scaled_{element}"}
    for name, part in (("rowwise", operand.rowwise), ("columnwise", operand.columnwise)):
        if part is not None:
            out[name] = _block_part(part)
    return out


@Registry.register_feature(namespace="transformer_engine")
class DumpTensors(TEConfigAPIMapper):
    """Saves the selected tensors (module docstring). Keys: ``tensors``/``tensors_struct``,
    ``high_precision_tensor`` and ``quantized_tensor`` (booleans, one of them true), ``freq``, ``start_step``,
    ``end_step`` and ``start_end_list`` (closed windows ``[start, end]``; -1: no end)."""

    uses_gemms = False
    option_keys = frozenset(DUMP_KEYS) | WINDOW_KEYS

    def __init__(self) -> None:
        super().__init__()
        self._owners: dict[str, tuple[str, str]] = {}  # this iteration's dump files -> (layer, tensor)
        self._owners_iteration: int | None = None

    def _unique_path(self, root: str, iteration: int, layer_name: str, tensor_name: str) -> str:
        """TE's file name, unless another tensor of this iteration has it already (names that sanitise alike)."""
        if iteration != self._owners_iteration:
            self._owners, self._owners_iteration = {}, iteration
        rank, names = get_distributed_rank(), (layer_name, tensor_name)
        path = dump_path(root, rank, iteration, *names)
        if self._owners.setdefault(path, names) != names:
            path = dump_path(root, rank, iteration, *names, clash=True)
        return path

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        collector = ErrorCollector()
        for key in DUMP_KEYS:
            if key in view and not isinstance(view[key], bool):
                collector.add(location.child(key).error("must be True or False", view[key], [True, False]))
        if not any(view.get(key) is True for key in DUMP_KEYS):
            collector.add(location.error("DumpTensors dumps nothing: set high_precision_tensor or quantized_tensor to True"))
        with collector.check():
            validate_window(view, location, closed=True)
        collector.raise_errors()

    @api_method
    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str, iteration: int) -> tuple[bool, int | None]:
        return schedule(config, iteration)

    @api_method
    def inspect_tensor(
        self, config: dict, layer_name: str, tensor_name: str, tensor: torch.Tensor | None, iteration: int, **kwargs: Any
    ) -> None:
        if not schedule(config, iteration)[0]:
            return
        dump: dict[str, Any] = {}
        if config.get("high_precision_tensor") and tensor is not None:
            dump["high_precision"] = tensor.detach().clone()
        if config.get("quantized_tensor"):
            operands = (kwargs.get("rowwise_quantized_tensor"), kwargs.get("columnwise_quantized_tensor"))
            operand = next((o for o in operands if isinstance(o, QuantizedTensor)), None)
            if operand is not None:
                dump["quantized"] = plain_quantized(operand)
            else:
                debug_api.log_message(
                    f"DumpTensors: {tensor_name} is not quantized this iteration; no quantized tensor", layer_name
                )
        if not dump:
            return
        root = get_logger().root_log_dir
        path = self._unique_path(root, iteration, layer_name, tensor_name)
        try:
            write_whole(dump, path, root)
        except OSError as error:
            say_once(
                f"DumpTensors cannot write tensor dumps in {os.path.join(root, 'tensor_dumps')}: "
                f"{error.strerror or error}. Each dump that cannot be written is skipped whole (no partial file is "
                "left) and training goes on; free space there, or turn DumpTensors off.",
                call_site=__name__,
            )
            return
        debug_api.log_message(
            f"Feature=DumpTensors: {tensor_name} at iteration {iteration} to {path} ({sorted(dump)})", layer_name
        )
