//! Tensor names: every naming scheme a DeepSeek-V4 checkpoint or host may use, mapped to the
//! canonical (upstream DeepSeek) names of `spec.rs`.
//!
//! Three schemes are accepted, and may be mixed (partially reverted names exist in the wild):
//! (a) upstream: `embed.weight`, `layers.0.attn.wq_a.weight`, `hc_head_fn`, ...;
//! (b) what transformers' `save_pretrained` writes by default: upstream names with a `model.`
//!     prefix, except `model.embed_tokens.weight`, `model.hc_head.hc_fn`, and
//!     `model.layers.L.attn.norm.weight` for the main KV norm (see MODEL.md §14);
//! (c) HF-native module paths: `model.layers.L.self_attn.q_a_proj.weight`,
//!     `...self_attn.compressor.indexer.scorer.weights_proj.weight`, `mlp.gate.e_score_correction_bias`,
//!     `attn_hc.fn`, `input_layernorm`, and the fused experts `mlp.experts.gate_up_proj`
//!     ([E, 2I, D] = concat(w1, w3) per expert) / `mlp.experts.down_proj` ([E, D, I]).
//!
//! Block-scale companions (`<module>.scale`, `<module>.weight_scale_inv`, `<param>_scale_inv`)
//! are recognised as scales of their weight; `mtp.*` (multi-token prediction) is recognised
//! so the loader can skip it. Whether a canonical name exists in a given model (layer count,
//! layer kind) is checked against the weight store, not here.

/// What a (non-scale) checkpoint tensor provides.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// One canonical weight of `spec.rs`.
    Tensor(String),
    /// HF-native `layers.L.mlp.experts.gate_up_proj` [E, 2I, D]: rows 0..I of expert e are
    /// `ffn.experts.e.w1.weight`, rows I..2I are `w3`.
    ExpertsGateUp(usize),
    /// HF-native `layers.L.mlp.experts.down_proj` [E, D, I]: expert e is `ffn.experts.e.w2.weight`.
    ExpertsDown(usize),
}

impl Target {
    /// Canonical-style description for messages.
    pub fn describe(&self) -> String {
        match self {
            Target::Tensor(n) => n.clone(),
            Target::ExpertsGateUp(l) => {
                format!("layers.{l}.ffn.experts.*.w1/w3.weight (fused gate_up_proj)")
            }
            Target::ExpertsDown(l) => {
                format!("layers.{l}.ffn.experts.*.w2.weight (fused down_proj)")
            }
        }
    }
}

/// Role of one checkpoint tensor name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Values of a weight.
    Weight(Target),
    /// Block scales of the weight that provides `Target`.
    Scale(Target),
    /// A multi-token-prediction tensor: not part of the main model, skipped.
    Mtp,
}

/// Classifies a tensor name of any scheme; None for a name no scheme knows.
pub fn classify(name: &str) -> Option<Role> {
    let bare = name.strip_prefix("model.").unwrap_or(name);
    if bare.starts_with("mtp.") {
        return Some(Role::Mtp);
    }
    // A real weight wins over a scale reading: `attn_hc.scale` is the mHC scale parameter.
    if let Some(t) = weight_target(name) {
        return Some(Role::Weight(t));
    }
    scale_target(name).map(Role::Scale)
}

/// Canonical name of a one-to-one weight name (None for scales, fused experts, MTP, unknown).
pub fn canonical_name(name: &str) -> Option<String> {
    match weight_target(name)? {
        Target::Tensor(n) => Some(n),
        _ => None,
    }
}

/// The weight a scale-companion name belongs to.
fn scale_target(name: &str) -> Option<Target> {
    // `X.weight_scale_inv` -> `X.weight`; `experts.gate_up_proj_scale_inv` -> `experts.gate_up_proj`.
    if let Some(base) = name.strip_suffix("_scale_inv") {
        return weight_target(base);
    }
    // `X.scale` -> `X.weight` (upstream V4), or `X.weight.scale` / `<param>.scale` -> that param.
    if let Some(base) = name.strip_suffix(".scale") {
        return weight_target(base).or_else(|| weight_target(&format!("{base}.weight")));
    }
    None
}

fn weight_target(name: &str) -> Option<Target> {
    let bare = name.strip_prefix("model.").unwrap_or(name);
    let parts: Vec<&str> = bare.split('.').collect();
    if let Some(g) = global(&parts) {
        return Some(Target::Tensor(g.to_owned()));
    }
    let ["layers", l, rest @ ..] = parts.as_slice() else {
        return None;
    };
    let l = index(l)?;
    match rest {
        ["ffn" | "mlp", "experts", "gate_up_proj"] => Some(Target::ExpertsGateUp(l)),
        ["ffn" | "mlp", "experts", "down_proj"] => Some(Target::ExpertsDown(l)),
        _ => layer(rest).map(|r| Target::Tensor(format!("layers.{l}.{r}"))),
    }
}

/// A decimal index written canonically (no sign, no leading zeros), so that two spellings
/// can never name the same tensor.
fn index(s: &str) -> Option<usize> {
    let v: usize = s.parse().ok()?;
    (v.to_string() == s).then_some(v)
}

fn global(p: &[&str]) -> Option<&'static str> {
    Some(match p {
        ["embed" | "embed_tokens", "weight"] => "embed.weight",
        ["head" | "lm_head", "weight"] => "head.weight",
        ["norm", "weight"] => "norm.weight",
        ["hc_head_fn"] | ["hc_head", "hc_fn" | "fn"] => "hc_head_fn",
        ["hc_head_base"] | ["hc_head", "hc_base" | "base"] => "hc_head_base",
        ["hc_head_scale"] | ["hc_head", "hc_scale" | "scale"] => "hc_head_scale",
        _ => return None,
    })
}

/// Per-layer name (after `layers.L.`) -> canonical per-layer name.
fn layer(p: &[&str]) -> Option<String> {
    let s = |x: &str| Some(x.to_owned());
    match p {
        ["attn_norm" | "input_layernorm", "weight"] => s("attn_norm.weight"),
        ["ffn_norm" | "post_attention_layernorm", "weight"] => s("ffn_norm.weight"),
        [hc] if is_upstream_hc(hc) => s(hc),
        [site @ ("attn_hc" | "ffn_hc"), param] => {
            let param = param.strip_prefix("hc_").unwrap_or(param);
            if !matches!(param, "fn" | "base" | "scale") {
                return None;
            }
            Some(format!("hc_{}_{param}", &site[..site.len() - 3]))
        }
        ["attn" | "self_attn", rest @ ..] => attn(rest).map(|r| format!("attn.{r}")),
        ["ffn" | "mlp", rest @ ..] => ffn(rest).map(|r| format!("ffn.{r}")),
        _ => None,
    }
}

fn is_upstream_hc(s: &str) -> bool {
    matches!(
        s,
        "hc_attn_fn"
            | "hc_attn_base"
            | "hc_attn_scale"
            | "hc_ffn_fn"
            | "hc_ffn_base"
            | "hc_ffn_scale"
    )
}

/// Attention names (after `attn.` / `self_attn.`).
fn attn(p: &[&str]) -> Option<String> {
    let s = |x: &str| Some(x.to_owned());
    match p {
        ["wq_a" | "q_a_proj", "weight"] => s("wq_a.weight"),
        ["q_norm" | "q_a_norm", "weight"] => s("q_norm.weight"),
        ["wq_b" | "q_b_proj", "weight"] => s("wq_b.weight"),
        ["wkv" | "kv_proj", "weight"] => s("wkv.weight"),
        // `attn.norm` is what save_pretrained writes for the main KV norm.
        ["kv_norm" | "norm", "weight"] => s("kv_norm.weight"),
        ["wo_a" | "o_a_proj", "weight"] => s("wo_a.weight"),
        ["wo_b" | "o_b_proj", "weight"] => s("wo_b.weight"),
        ["attn_sink" | "sinks"] => s("attn_sink"),
        // HF nests the indexer inside the compressor; upstream keeps it beside.
        ["indexer", rest @ ..] | ["compressor", "indexer", rest @ ..] => {
            indexer(rest).map(|r| format!("indexer.{r}"))
        }
        ["compressor", rest @ ..] => compressor(rest).map(|r| format!("compressor.{r}")),
        _ => None,
    }
}

/// Indexer names (after `attn.indexer.` / `self_attn.compressor.indexer.`).
fn indexer(p: &[&str]) -> Option<String> {
    let s = |x: &str| Some(x.to_owned());
    match p {
        ["wq_b" | "q_b_proj", "weight"] => s("wq_b.weight"),
        ["weights_proj", "weight"] | ["scorer", "weights_proj", "weight"] => {
            s("weights_proj.weight")
        }
        // Upstream: `indexer.compressor.wkv`; HF: the indexer's own compressor params directly.
        ["compressor", rest @ ..] | rest => compressor(rest).map(|r| format!("compressor.{r}")),
    }
}

/// Compressor names (main or indexer compressor).
fn compressor(p: &[&str]) -> Option<String> {
    let s = |x: &str| Some(x.to_owned());
    match p {
        ["wkv" | "kv_proj", "weight"] => s("wkv.weight"),
        ["wgate" | "gate_proj", "weight"] => s("wgate.weight"),
        ["norm" | "kv_norm", "weight"] => s("norm.weight"),
        ["ape" | "position_bias"] => s("ape"),
        _ => None,
    }
}

/// MoE names (after `ffn.` / `mlp.`), fused experts excluded.
fn ffn(p: &[&str]) -> Option<String> {
    let s = |x: &str| Some(x.to_owned());
    let w = |w: &str| -> Option<&'static str> {
        Some(match w {
            "w1" | "gate_proj" => "w1",
            "w2" | "down_proj" => "w2",
            "w3" | "up_proj" => "w3",
            _ => return None,
        })
    };
    match p {
        ["gate", "weight"] => s("gate.weight"),
        ["gate", "bias" | "e_score_correction_bias"] => s("gate.bias"),
        ["gate", "tid2eid"] => s("gate.tid2eid"),
        ["shared_experts", which, "weight"] => Some(format!("shared_experts.{}.weight", w(which)?)),
        ["experts", e, which, "weight"] => {
            Some(format!("experts.{}.{}.weight", index(e)?, w(which)?))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::weights::spec::tensor_specs;

    fn canon(n: &str) -> Option<String> {
        canonical_name(n)
    }

    #[test]
    fn upstream_names_are_fixed_points() {
        for spec in tensor_specs(&ModelConfig::tiny_default()) {
            assert_eq!(
                canon(&spec.name).as_deref(),
                Some(spec.name.as_str()),
                "{}",
                spec.name
            );
            // The `model.` prefix (scheme b) is accepted everywhere.
            assert_eq!(
                canon(&format!("model.{}", spec.name)).as_deref(),
                Some(spec.name.as_str())
            );
        }
    }

    #[test]
    fn save_pretrained_and_native_names() {
        let cases = [
            ("model.embed_tokens.weight", "embed.weight"),
            ("lm_head.weight", "head.weight"),
            ("head.weight", "head.weight"),
            ("model.norm.weight", "norm.weight"),
            ("model.hc_head.hc_fn", "hc_head_fn"),
            ("model.hc_head.hc_base", "hc_head_base"),
            ("model.hc_head.hc_scale", "hc_head_scale"),
            (
                "model.layers.0.attn.norm.weight",
                "layers.0.attn.kv_norm.weight",
            ),
            ("model.layers.2.ffn.gate.bias", "layers.2.ffn.gate.bias"),
            ("model.layers.0.attn_hc.fn", "layers.0.hc_attn_fn"),
            ("model.layers.0.attn_hc.base", "layers.0.hc_attn_base"),
            ("model.layers.0.attn_hc.scale", "layers.0.hc_attn_scale"),
            ("model.layers.1.ffn_hc.scale", "layers.1.hc_ffn_scale"),
            (
                "model.layers.0.input_layernorm.weight",
                "layers.0.attn_norm.weight",
            ),
            (
                "model.layers.0.post_attention_layernorm.weight",
                "layers.0.ffn_norm.weight",
            ),
            (
                "model.layers.0.self_attn.q_a_proj.weight",
                "layers.0.attn.wq_a.weight",
            ),
            (
                "model.layers.0.self_attn.q_a_norm.weight",
                "layers.0.attn.q_norm.weight",
            ),
            (
                "model.layers.0.self_attn.q_b_proj.weight",
                "layers.0.attn.wq_b.weight",
            ),
            (
                "model.layers.0.self_attn.kv_proj.weight",
                "layers.0.attn.wkv.weight",
            ),
            (
                "model.layers.0.self_attn.kv_norm.weight",
                "layers.0.attn.kv_norm.weight",
            ),
            (
                "model.layers.0.self_attn.o_a_proj.weight",
                "layers.0.attn.wo_a.weight",
            ),
            (
                "model.layers.0.self_attn.o_b_proj.weight",
                "layers.0.attn.wo_b.weight",
            ),
            ("model.layers.0.self_attn.sinks", "layers.0.attn.attn_sink"),
            (
                "model.layers.0.self_attn.compressor.kv_proj.weight",
                "layers.0.attn.compressor.wkv.weight",
            ),
            (
                "model.layers.0.self_attn.compressor.gate_proj.weight",
                "layers.0.attn.compressor.wgate.weight",
            ),
            (
                "model.layers.0.self_attn.compressor.kv_norm.weight",
                "layers.0.attn.compressor.norm.weight",
            ),
            (
                "model.layers.0.self_attn.compressor.position_bias",
                "layers.0.attn.compressor.ape",
            ),
            (
                "model.layers.0.self_attn.compressor.indexer.q_b_proj.weight",
                "layers.0.attn.indexer.wq_b.weight",
            ),
            (
                "model.layers.0.self_attn.compressor.indexer.scorer.weights_proj.weight",
                "layers.0.attn.indexer.weights_proj.weight",
            ),
            (
                "model.layers.0.self_attn.compressor.indexer.kv_proj.weight",
                "layers.0.attn.indexer.compressor.wkv.weight",
            ),
            (
                "model.layers.0.self_attn.compressor.indexer.gate_proj.weight",
                "layers.0.attn.indexer.compressor.wgate.weight",
            ),
            (
                "model.layers.0.self_attn.compressor.indexer.kv_norm.weight",
                "layers.0.attn.indexer.compressor.norm.weight",
            ),
            (
                "model.layers.0.self_attn.compressor.indexer.position_bias",
                "layers.0.attn.indexer.compressor.ape",
            ),
            (
                "model.layers.1.mlp.gate.e_score_correction_bias",
                "layers.1.ffn.gate.bias",
            ),
            (
                "model.layers.0.mlp.gate.tid2eid",
                "layers.0.ffn.gate.tid2eid",
            ),
            ("model.layers.0.mlp.gate.weight", "layers.0.ffn.gate.weight"),
            (
                "model.layers.0.mlp.shared_experts.gate_proj.weight",
                "layers.0.ffn.shared_experts.w1.weight",
            ),
            (
                "model.layers.0.mlp.shared_experts.down_proj.weight",
                "layers.0.ffn.shared_experts.w2.weight",
            ),
            (
                "model.layers.0.mlp.shared_experts.up_proj.weight",
                "layers.0.ffn.shared_experts.w3.weight",
            ),
            (
                "model.layers.3.mlp.experts.5.up_proj.weight",
                "layers.3.ffn.experts.5.w3.weight",
            ),
        ];
        for (from, to) in cases {
            assert_eq!(canon(from).as_deref(), Some(to), "{from}");
        }
        assert_eq!(
            classify("model.layers.4.mlp.experts.gate_up_proj"),
            Some(Role::Weight(Target::ExpertsGateUp(4)))
        );
        assert_eq!(
            classify("model.layers.4.mlp.experts.down_proj"),
            Some(Role::Weight(Target::ExpertsDown(4)))
        );
    }

    #[test]
    fn scales_mtp_and_unknown() {
        let t = |n: &str| Target::Tensor(n.to_owned());
        // (scale name, the weight it scales). A scale name of an unquantisable weight is still
        // a scale (the loader rejects it).
        for (name, weight) in [
            ("layers.0.attn.wq_a.scale", "layers.0.attn.wq_a.weight"),
            (
                "model.layers.0.self_attn.q_a_proj.weight_scale_inv",
                "layers.0.attn.wq_a.weight",
            ),
            (
                "layers.1.ffn.experts.3.w2.weight.scale",
                "layers.1.ffn.experts.3.w2.weight",
            ),
            ("layers.0.hc_attn_fn.scale", "layers.0.hc_attn_fn"),
        ] {
            assert_eq!(classify(name), Some(Role::Scale(t(weight))), "{name}");
        }
        assert_eq!(
            classify("model.layers.1.mlp.experts.gate_up_proj_scale_inv"),
            Some(Role::Scale(Target::ExpertsGateUp(1)))
        );
        // Real mHC scale parameters are weights, not block scales.
        for (name, weight) in [
            ("model.layers.0.attn_hc.scale", "layers.0.hc_attn_scale"),
            ("hc_head_scale", "hc_head_scale"),
        ] {
            assert_eq!(classify(name), Some(Role::Weight(t(weight))), "{name}");
        }
        for mtp in [
            "mtp.0.e_proj.weight",
            "mtp.0.e_proj.scale",
            "model.mtp.0.hc_head_fn",
        ] {
            assert_eq!(classify(mtp), Some(Role::Mtp), "{mtp}");
        }
        for bad in [
            "layers.01.attn.wq_a.weight",
            "layers.+1.attn.wq_a.weight",
            "layers.0.attn.wq_c.weight",
            "layers.0.attn.wq_a",
            "layers.0.attn.wq_a.weight.extra",
            "layers.0.ffn.experts.x.w1.weight",
            "layers.0.attn_hc.bias",
            "decoder.embed.weight",
            "",
            "layers",
            "model.",
        ] {
            assert_eq!(classify(bad), None, "{bad}");
        }
    }
}
