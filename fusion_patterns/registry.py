"""The fusion patterns, in the order the claims stage runs them (as vLLM's `FUSERS`).

Order matters where one pattern reads another's claims: the subclasses of nn.Linear
proven to compute one first (a construction no other pattern claims), the mixers that
keep state next (vLLM's layer holds their norm and projections: nothing else claims them), norms
(the attention's head norms, the residual fold and the latent attention build on
proven norms), then the
blocks inside a layer (a MoE block before a gated MLP, so a router is never taken for a
gate, and before its experts alone, taken only where the block is not), then the attention whole (latent, then vLLM's own layout) before the merge of a
copied attention's projections, vLLM's rope in a copied attention and vLLM's positions
for a count from the cache, the residual fold, and the activations picked by name last
(only in classes no pattern emits whole).
"""

from .activation import Activation
from .activation_names import ActivationNames
from .cache_positions import CachePositions
from .gated_delta_net import GatedDeltaNet
from .glu import GLU
from .linear_subclass import LinearSubclass
from .mamba1 import Mamba1
from .mamba2 import Mamba2
from .mla import LatentAttention
from .moe import MoE
from .qkv import NativeAttention, QKVMerge
from .residual_norm import ResidualFold
from .routed_experts import RoutedExperts
from .rms_norm import RMSNormPattern
from .rotary import Rope
from .short_conv import ShortConvPattern
from .state_layers import StateMixer

PATTERNS = (
    # a subclass of nn.Linear proven to compute it: built as nn.Linear is
    LinearSubclass(),
    Mamba2(),
    Mamba1(),
    ShortConvPattern(),
    GatedDeltaNet(),
    RMSNormPattern(),
    Activation(),
    MoE(),
    RoutedExperts(),
    GLU(),
    LatentAttention(),
    NativeAttention(),
    QKVMerge(),
    Rope(),
    CachePositions(),
    ResidualFold(),
    # last: a class another pattern emits whole builds its activation its own way
    ActivationNames(),
)


def mapped_state_kinds() -> list[str]:
    """What the stateful-mixer patterns map ("Mamba-2 mixer", "gated DeltaNet", ...)."""
    return [p.what for p in PATTERNS if isinstance(p, StateMixer)]


def state_patterns(info) -> set[str]:
    """Names of the patterns that would map `info`, a class keeping state across decode
    steps, onto a vLLM layer with a state cache (their claims prove it or say why not).
    """
    return {p.name for p in PATTERNS if p.maps_state(info)}
