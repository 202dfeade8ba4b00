//! The HF-native module names (naming scheme c) of upstream tensor names, written once for
//! the tests that rename a checkpoint into that scheme.

/// Scheme (c) names: the HF-native module path of an upstream (canonical) tensor name, for
/// the one-to-one tensors; None for routed experts (fused under HF-native names) and for
/// names the table does not know.
pub fn native_name(c: &str) -> Option<String> {
    let global = match c {
        "embed.weight" => Some("model.embed_tokens.weight"),
        "head.weight" => Some("lm_head.weight"),
        "norm.weight" => Some("model.norm.weight"),
        "hc_head_fn" => Some("model.hc_head.hc_fn"),
        "hc_head_base" => Some("model.hc_head.hc_base"),
        "hc_head_scale" => Some("model.hc_head.hc_scale"),
        _ => None,
    };
    if let Some(g) = global {
        return Some(g.into());
    }
    let rest = c.strip_prefix("layers.")?;
    let (l, rest) = rest.split_once('.')?;
    if rest.starts_with("ffn.experts.") {
        return None;
    }
    let table = [
        ("attn_norm.weight", "input_layernorm.weight"),
        ("ffn_norm.weight", "post_attention_layernorm.weight"),
        ("hc_attn_fn", "attn_hc.fn"),
        ("hc_attn_base", "attn_hc.base"),
        ("hc_attn_scale", "attn_hc.scale"),
        ("hc_ffn_fn", "ffn_hc.fn"),
        ("hc_ffn_base", "ffn_hc.base"),
        ("hc_ffn_scale", "ffn_hc.scale"),
        ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
        ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
        ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
        ("attn.wkv.weight", "self_attn.kv_proj.weight"),
        ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
        ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
        ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
        ("attn.attn_sink", "self_attn.sinks"),
        (
            "attn.compressor.wkv.weight",
            "self_attn.compressor.kv_proj.weight",
        ),
        (
            "attn.compressor.wgate.weight",
            "self_attn.compressor.gate_proj.weight",
        ),
        (
            "attn.compressor.norm.weight",
            "self_attn.compressor.kv_norm.weight",
        ),
        ("attn.compressor.ape", "self_attn.compressor.position_bias"),
        (
            "attn.indexer.wq_b.weight",
            "self_attn.compressor.indexer.q_b_proj.weight",
        ),
        (
            "attn.indexer.weights_proj.weight",
            "self_attn.compressor.indexer.scorer.weights_proj.weight",
        ),
        (
            "attn.indexer.compressor.wkv.weight",
            "self_attn.compressor.indexer.kv_proj.weight",
        ),
        (
            "attn.indexer.compressor.wgate.weight",
            "self_attn.compressor.indexer.gate_proj.weight",
        ),
        (
            "attn.indexer.compressor.norm.weight",
            "self_attn.compressor.indexer.kv_norm.weight",
        ),
        (
            "attn.indexer.compressor.ape",
            "self_attn.compressor.indexer.position_bias",
        ),
        ("ffn.gate.weight", "mlp.gate.weight"),
        ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
        ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
        (
            "ffn.shared_experts.w1.weight",
            "mlp.shared_experts.gate_proj.weight",
        ),
        (
            "ffn.shared_experts.w2.weight",
            "mlp.shared_experts.down_proj.weight",
        ),
        (
            "ffn.shared_experts.w3.weight",
            "mlp.shared_experts.up_proj.weight",
        ),
    ];
    let native = table.iter().find(|(u, _)| *u == rest).map(|(_, n)| *n)?;
    Some(format!("model.layers.{l}.{native}"))
}
