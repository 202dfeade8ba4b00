//! The same model saved under the three naming schemes (upstream DeepSeek names, what
//! transformers' save_pretrained writes, HF-native module names with fused experts) loads
//! to bit-identical weights and gives bit-identical logits. The schemes are produced here
//! from the tiny fixture (scheme b) by renaming; the tensors' bytes are not changed.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::fixture_dir;
use common::names::native_name;
use dsv4::weights::names::canonical_name;
use dsv4::{Batch, ConfigSource, Engine, EngineOptions, LoadFormat, LogitsOut, Numerics};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

struct Owned {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn read(path: &Path) -> BTreeMap<String, Owned> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                Owned {
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    data: t.data().to_vec(),
                },
            )
        })
        .collect()
}

fn write(dir: &Path, tensors: &BTreeMap<String, Owned>) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(
        fixture_dir("tiny").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Scheme (a): every tensor under its canonical upstream name.
fn upstream(b: &BTreeMap<String, Owned>) -> BTreeMap<String, Owned> {
    b.iter()
        .map(|(n, t)| {
            let c = canonical_name(n).unwrap_or_else(|| panic!("{n} has no canonical name"));
            (
                c,
                Owned {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data: t.data.clone(),
                },
            )
        })
        .collect()
}

/// Scheme (c): HF-native names, experts fused into gate_up_proj [E, 2I, D] / down_proj [E, D, I].
/// A fused tensor being assembled: (codes, scales, code shape, scale shape, dtype).
type Fused = (Vec<u8>, Vec<u8>, Vec<usize>, Vec<usize>, Dtype);

fn native(a: &BTreeMap<String, Owned>, experts: usize) -> BTreeMap<String, Owned> {
    let mut out = BTreeMap::new();
    let mut fused: BTreeMap<String, Fused> = BTreeMap::new();
    for (c, t) in a {
        if let Some((layer, _)) = c
            .strip_prefix("layers.")
            .and_then(|r| r.split_once(".ffn.experts."))
        {
            fused
                .entry(layer.to_string())
                .or_insert_with(|| (vec![], vec![], vec![], vec![], t.dtype));
            continue;
        }
        out.insert(
            native_name(c).unwrap_or_else(|| panic!("no native name for {c}")),
            Owned {
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: t.data.clone(),
            },
        );
    }
    for (layer, (gate_up, down, gu_shape, d_shape, dtype)) in fused.iter_mut() {
        for e in 0..experts {
            let get = |w: &str| &a[&format!("layers.{layer}.ffn.experts.{e}.{w}.weight")];
            let (w1, w2, w3) = (get("w1"), get("w2"), get("w3"));
            gate_up.extend_from_slice(&w1.data);
            gate_up.extend_from_slice(&w3.data);
            down.extend_from_slice(&w2.data);
            *gu_shape = vec![experts, 2 * w1.shape[0], w1.shape[1]];
            *d_shape = vec![experts, w2.shape[0], w2.shape[1]];
        }
        let p = format!("model.layers.{layer}.mlp.experts");
        out.insert(
            format!("{p}.gate_up_proj"),
            Owned {
                dtype: *dtype,
                shape: gu_shape.clone(),
                data: std::mem::take(gate_up),
            },
        );
        out.insert(
            format!("{p}.down_proj"),
            Owned {
                dtype: *dtype,
                shape: d_shape.clone(),
                data: std::mem::take(down),
            },
        );
    }
    out
}

fn logits_of(dir: &Path) -> (Vec<f32>, Vec<Vec<u8>>) {
    let opts = EngineOptions {
        max_num_seqs: 1,
        max_num_tokens: 64,
        max_seq_len: 64,
        numerics: Numerics::Exact,
        ..Default::default()
    };
    let mut e = Engine::create(ConfigSource::Path(dir.to_path_buf()), opts).unwrap();
    e.load(Some(dir), LoadFormat::Auto).unwrap();
    e.finalize().unwrap();
    let weights: Vec<Vec<u8>> = e
        .weights()
        .tensors()
        .iter()
        .map(|t| {
            let n = t.spec.numel() * 4;
            // SAFETY: f32/i32 storage of numel elements (the tiny config is unquantized).
            unsafe { std::slice::from_raw_parts(t.data.as_ptr(), n).to_vec() }
        })
        .collect();
    let toks: Vec<i32> = (0..40).map(|i| i * 37 % 256).collect();
    let pos: Vec<i32> = (0..40).collect();
    let mut out = vec![0f32; 40 * e.config().vocab_size];
    e.forward(&mut Batch {
        token_ids: &toks,
        positions: &pos,
        seq_slots: &[0],
        query_start: &[0, 40],
        logits_rows: None,
        logits: LogitsOut::F32(&mut out),
    })
    .unwrap();
    (out, weights)
}

fn temp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dsv4-names-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn three_schemes_give_bit_identical_weights_and_logits() {
    let b = read(&fixture_dir("tiny").join("model.safetensors"));
    let a = upstream(&b);
    let c = native(&a, 8);
    assert!(c.keys().any(|k| k.ends_with("mlp.experts.gate_up_proj")));
    assert!(a.contains_key("layers.0.attn.kv_norm.weight") && a.contains_key("hc_head_fn"));
    let (da, dc) = (temp("a"), temp("c"));
    write(&da, &a);
    write(&dc, &c);
    let (lb, wb) = logits_of(&fixture_dir("tiny"));
    let (la, wa) = logits_of(&da);
    let (lc, wc) = logits_of(&dc);
    assert!(
        wa == wb,
        "upstream-named weights differ from save_pretrained-named ones"
    );
    assert!(
        wc == wb,
        "HF-native-named weights differ from save_pretrained-named ones"
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&la), bits(&lb), "upstream vs save_pretrained logits");
    assert_eq!(bits(&lc), bits(&lb), "HF-native vs save_pretrained logits");
    let _ = std::fs::remove_dir_all(&da);
    let _ = std::fs::remove_dir_all(&dc);
}
