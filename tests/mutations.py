"""Semantic mutations of real transformers modeling sources, and what each must end as.

Each mutant is (id, model, old text, new text, expectation). Expectations:
- ("refused", reason): the native layout refuses it with that reason; `apply` then
  either exits 2 with it (nothing written) or falls back to the faithful tier, which
  reports it (`Unfused: native layout ...`) and must verify equal;
- ("equal", [refusal fragments]): generated (with exactly those refusals reported, the
  rest fused) and verified equal to the mutated source in real vLLM.
Zero silently wrong models: there is no third outcome.
"""

GLU = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
NORM_MATH = "hidden_states * torch.rsqrt(variance + self.variance_epsilon)"
NORM_RETURN = "return self.weight * hidden_states.to(input_dtype)"
Q_LINE = "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)"
K_LINE = "key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)"
V_LINE = "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)"
ATTN_ADD = "hidden_states = residual + hidden_states\n\n        # Fully Connected"
SAVE_NORM = "residual = hidden_states\n        hidden_states = self.input_layernorm(hidden_states)"
V_PROJ = "self.v_proj = nn.Linear(\n            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias"
MLP_NO_PRODUCT = "forward has no `down(act(gate(x)) * up(x))` product"

MUTANTS = [
    # GLU
    (
        "glu-operands-swapped",
        GLU,
        "self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))",
        ("equal", []),
    ),
    (
        "glu-activation-on-up",
        GLU,
        "self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))",
        ("equal", []),
    ),
    (
        "glu-sum-not-product",
        GLU,
        "self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))",
        ("equal", [MLP_NO_PRODUCT]),
    ),
    (
        "glu-activation-on-both",
        GLU,
        "self.down_proj(self.act_fn(self.gate_proj(x)) * self.act_fn(self.up_proj(x)))",
        ("equal", ["gate and up read different tensors"]),
    ),
    (
        "glu-product-scaled",
        GLU,
        "self.down_proj(0.5 * (self.act_fn(self.gate_proj(x)) * self.up_proj(x)))",
        ("equal", [MLP_NO_PRODUCT]),
    ),
    (
        "glu-up-reads-other",
        GLU,
        "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x * 2))",
        ("refused", "neither reads the input nor makes the output"),
    ),
    (
        "glu-tanh-gelu",
        "self.act_fn = ACT2FN[config.hidden_act]",
        'self.act_fn = ACT2FN["gelu_pytorch_tanh"]',
        ("equal", []),
    ),
    (
        "glu-no-fused-kernel",
        "self.act_fn = ACT2FN[config.hidden_act]",
        'self.act_fn = ACT2FN["relu2"]',
        ("equal", ["no fused ...AndMul for activation 'relu2'"]),
    ),
    # QKV
    (
        "k-reads-other-tensor",
        K_LINE,
        K_LINE.replace("self.k_proj(hidden_states)", "self.k_proj(hidden_states * 2)"),
        ("refused", "self.k_proj is not applied to a plain name"),
    ),
    (
        "input-rebound-between-q-and-k",
        Q_LINE,
        Q_LINE + "\n        hidden_states = hidden_states * 2",
        ("refused", "the projections consume different graph nodes"),
    ),
    (
        "extra-op-on-v",
        V_LINE,
        V_LINE.replace(
            "self.v_proj(hidden_states)", "torch.tanh(self.v_proj(hidden_states))"
        ),
        ("refused", "between a projection and attention"),
    ),
    (
        "extra-op-before-k-norm",
        K_LINE,
        K_LINE.replace(".view(hidden_shape))", ".view(hidden_shape) * 2)"),
        ("refused", "between a projection and attention"),
    ),
    (
        "bias-on-v-only",
        V_PROJ,
        V_PROJ.replace("bias=config.attention_bias", "bias=True"),
        ("refused", "bias differs between the projections"),
    ),
    (
        "q-norm-over-whole-projection",
        Q_LINE,
        Q_LINE.replace(
            "self.q_proj(hidden_states).view(hidden_shape))",
            "self.q_proj(hidden_states)).view(hidden_shape)",
        ),
        ("refused", "norm over the whole projection"),
    ),
    (
        "q-and-k-roles-swapped",
        "query_states,\n            key_states,\n            value_states,",
        "key_states,\n            query_states,\n            value_states,",
        ("refused", "key and value do not share one head layout"),
    ),
    (
        "extra-op-before-o-proj",
        "attn_output = self.o_proj(attn_output)",
        "attn_output = self.o_proj(attn_output * 2)",
        ("refused", "o_proj on the attention output: the fused form differs"),
    ),
    (
        "scaling-changed",
        "self.scaling = self.head_dim**-0.5",
        "self.scaling = 0.5 * self.head_dim**-0.5",
        ("equal", []),
    ),
    # RMSNorm
    (
        "eps-outside-root",
        NORM_MATH,
        "hidden_states * torch.rsqrt(variance) + self.variance_epsilon",
        (
            "equal",
            [
                "eps is not added inside the root",
                "self.input_layernorm is not an RMSNorm",
            ],
        ),
    ),
    (
        "eps-constant",
        NORM_MATH,
        "hidden_states * torch.rsqrt(variance + 1e-2)",
        (
            "equal",
            [
                "eps is not added inside the root",
                "self.input_layernorm is not an RMSNorm",
            ],
        ),
    ),
    (
        "weight-before-cast",
        NORM_RETURN,
        "return (self.weight * hidden_states).to(input_dtype)",
        (
            "equal",
            [
                "the weight is not applied as a multiply after the cast back",
                "self.input_layernorm is not an RMSNorm",
            ],
        ),
    ),
    (
        "one-plus-weight",
        NORM_RETURN,
        "return (1.0 + self.weight) * hidden_states.to(input_dtype)",
        ("equal", []),
    ),
    # Residual
    (
        "residual-subtracted",
        ATTN_ADD,
        ATTN_ADD.replace("residual + hidden_states", "residual - hidden_states"),
        ("equal", ["is not the residual add"]),
    ),
    (
        "residual-scaled",
        ATTN_ADD,
        ATTN_ADD.replace("residual + hidden_states", "residual + 0.5 * hidden_states"),
        # a multiplier on the mixer's output (Granite's pattern): fused, the scale kept
        ("equal", []),
    ),
    (
        "residual-taken-after-norm",
        SAVE_NORM,
        "hidden_states = self.input_layernorm(hidden_states)\n        residual = hidden_states",
        ("equal", ["does not save the residual stream"]),
    ),
]
