"""torchshell: the PyTorch side users touch — Lightning module, data, tracking, export, CLI."""

from torchshell.module import JaxModule
from torchshell.torch_model import params_to_state_dict, torch_model_fns

__all__ = ["JaxModule", "params_to_state_dict", "torch_model_fns"]
