"""Seed 000's ``FakeQuant`` feature as the seed writes it, plus the ``torch`` import and a config check."""

import torch
from sample_feature_api import SampleConfigAPIMapper

from nvdlfw_inspect.registry import Registry, api_method


@Registry.register_feature(namespace="sample_namespace")
class FakeQuant(SampleConfigAPIMapper):
    """
    Fake Quantization feature in Pytorch with torch.fake_quantize_per_tensor_affine
    Returns a new tensor with the data in input fake quantized using scale, zero_point, quant_min and quant_max.

    APIs:
    1. sample_namespace.process_tensor
    - When using this api, you would need to pass args:
    -- layer_name: : this is matched with the layer description in the config file
    -- gemm: this is matched with one of the gemms in the config field, and passed as a kwarg. For example, gemm='gemm1'
    -- tensor_name: this is matched with one of the tensors in the config field for a given gemm, and passed as a kwarg.
    -- tensor: the tensor to process, and passed as a kwarg. For example, tensor={torch tensor}

    Config fields:
    This feature works at a tensor level, you can set the following properties for each tensor:
    - scale: double or float32 scalar, quantization scalar
    - zero_point: int scalar or tensor, quantization zero_point
    - quant_min: int, lower bound of quantized domain
    - quant_max: int, upper bound of quantized domain

    Gemm and Tensor structure is described below:
    """

    @classmethod
    def _set_class_doc(cls):
        cls.__doc__ = (
            f"\n{cls.__doc__}\n  gemm and tensor structure in yaml will be as follows: "
            f"{SampleConfigAPIMapper.gemm_and_tensor_config_docstring}"
        )

    def validate_config(self, config, location):
        """Beyond the seed: report a missing quantization field at ``initialize``, not at the first call."""
        super().validate_config(config, location)
        for field in ["scale", "zero_point", "quant_min", "quant_max"]:
            if field not in config:
                raise location.error(f"missing '{field}': FakeQuant needs scale, zero_point, quant_min and quant_max")

    @api_method
    def process_tensor(self, config, layer_name, **kwargs):
        self.log_message_once(
            f"Feature={self.__class__.__name__}, API=process_tensor: {kwargs['gemm']}, {kwargs['tensor_name']}: FakeQuant",
            layer_name,
        )

        for field in ["scale", "zero_point", "quant_min", "quant_max"]:
            if field not in config:
                raise ValueError(
                    f"[NVDLFW INSPECT ERROR] Feature={self.__class__.__name__}, API=process_tensor: {field} missing for "
                    f"Tensor: {kwargs['tensor_name']} in the config yaml for FakeQuant feature which is a required field"
                )

        q_tensor = torch.fake_quantize_per_tensor_affine(
            kwargs["tensor"], config["scale"], config["zero_point"], config["quant_min"], config["quant_max"]
        )
        return {"tensor": q_tensor}


FakeQuant._set_class_doc()
