//! The same model saved under the three naming schemes (upstream DeepSeek names, what
//! transformers' save_pretrained writes, HF-native module names with fused experts) loads
//! to bit-identical weights and gives bit-identical logits. The schemes are produced here
//! from the tiny fixture (scheme b) by renaming; the tensors' bytes are not changed.

mod common;

use dsv4::weights::store::TensorData;
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
        .host_store()
        .expect("CPU engine")
        .tensors()
        .iter()
        .map(|t| {
            let elem = if matches!(t.data, TensorData::Bf16(_)) {
                2
            } else {
                4
            };
            let n = t.spec.numel() * elem;
            // SAFETY: f32/i32 or BF16 storage of numel elements (the tiny config is unquantized).
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

/// dsv4_canonical_name (ABI 1.3): every accepted spelling maps to what it stands for in the
/// engine's model; unknown names and weights the model lacks are TENSOR errors naming them; a
/// short buffer is CAPACITY with the length and kind still reported.
#[test]
fn canonical_name_maps_every_scheme_scales_fused_experts_and_mtp() {
    use dsv4::ffi::*;
    use std::ffi::{CStr, CString};
    let mut p = dsv4_create_params_default();
    p.use_tiny_default = 1;
    let mut e = std::ptr::null_mut();
    unsafe { common::abi::ok(dsv4_create(&p, &mut e)) };
    let map = |name: &str| -> (dsv4_status, i32, String, usize) {
        let n = CString::new(name).unwrap();
        let mut buf = [0 as std::ffi::c_char; 128];
        let (mut len, mut kind) = (0usize, -1i32);
        let st = unsafe {
            dsv4_canonical_name(
                e,
                n.as_ptr(),
                buf.as_mut_ptr(),
                buf.len(),
                &mut len,
                &mut kind,
            )
        };
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_owned();
        (st, kind, s, len)
    };
    let wq_a = "layers.0.attn.wq_a.weight";
    for (name, kind, want) in [
        (wq_a, DSV4_NAME_WEIGHT, wq_a),
        ("model.layers.0.attn.wq_a.weight", DSV4_NAME_WEIGHT, wq_a),
        (
            "model.layers.0.self_attn.q_a_proj.weight",
            DSV4_NAME_WEIGHT,
            wq_a,
        ),
        ("layers.0.attn.wq_a.scale", DSV4_NAME_SCALE, wq_a),
        (
            "model.layers.0.self_attn.q_a_proj.weight_scale_inv",
            DSV4_NAME_SCALE,
            wq_a,
        ),
        (
            "model.embed_tokens.weight",
            DSV4_NAME_WEIGHT,
            "embed.weight",
        ),
        (
            "model.layers.1.mlp.experts.gate_up_proj",
            DSV4_NAME_FUSED_GATE_UP,
            "layers.1.ffn.experts",
        ),
        (
            "model.layers.1.mlp.experts.down_proj",
            DSV4_NAME_FUSED_DOWN,
            "layers.1.ffn.experts",
        ),
        (
            "mtp.0.e_proj.weight",
            DSV4_NAME_SKIPPED,
            "mtp.0.e_proj.weight",
        ),
    ] {
        let (st, k, got, len) = map(name);
        assert_eq!(st, DSV4_STATUS_OK, "{name}: {}", common::abi::last_error());
        assert_eq!((k, got.as_str(), len), (kind, want, want.len()), "{name}");
    }
    for (name, needle) in [
        ("layers.0.attn.no_such.weight", "no naming scheme"),
        (
            "layers.99.attn.wq_a.weight",
            "no weight `layers.99.attn.wq_a.weight`",
        ),
    ] {
        let (st, _, _, _) = map(name);
        assert_eq!(st, DSV4_STATUS_TENSOR, "{name}");
        let msg = common::abi::last_error();
        assert!(msg.contains(name) && msg.contains(needle), "{name}: {msg}");
    }
    // Too small a buffer: CAPACITY, the length and kind still set, a NUL-terminated prefix.
    let n = CString::new("model.layers.0.self_attn.q_a_proj.weight").unwrap();
    let mut small = [0x7f as std::ffi::c_char; 8];
    let (mut len, mut kind) = (0usize, -1i32);
    let st = unsafe {
        dsv4_canonical_name(
            e,
            n.as_ptr(),
            small.as_mut_ptr(),
            small.len(),
            &mut len,
            &mut kind,
        )
    };
    assert_eq!(
        (st, len, kind),
        (DSV4_STATUS_CAPACITY, wq_a.len(), DSV4_NAME_WEIGHT)
    );
    assert_eq!(
        unsafe { CStr::from_ptr(small.as_ptr()) }.to_str().unwrap(),
        &wq_a[..7]
    );
    // Length query with no buffer.
    let st =
        unsafe { dsv4_canonical_name(e, n.as_ptr(), std::ptr::null_mut(), 0, &mut len, &mut kind) };
    assert_eq!((st, len), (DSV4_STATUS_CAPACITY, wq_a.len()));
    let st = unsafe {
        dsv4_canonical_name(
            e,
            std::ptr::null(),
            small.as_mut_ptr(),
            8,
            &mut len,
            &mut kind,
        )
    };
    assert_eq!(st, DSV4_STATUS_NULL_POINTER);
    unsafe { dsv4_destroy(e) };
}
