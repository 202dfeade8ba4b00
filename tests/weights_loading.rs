//! Checkpoint loading end to end through the public `dsv4::weights` API: small safetensors
//! checkpoints are written in each naming scheme (upstream, transformers `save_pretrained`,
//! HF-native with fused experts), with FP8 block-quantised linears (ragged edge blocks) and
//! packed FP4 experts, and must load bit-identically to values computed here independently.
//! Then every error case must come back with its status and a message naming the culprit.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::TempDir;
use common::names::native_name;
use common::rng::XorShift;
use dsv4::weights::load::load_checkpoint;
use dsv4::weights::spec::{ElemKind, StoredAs, TensorSpec, tensor_specs};
use dsv4::weights::store::{TensorData, WeightStore};
use dsv4::{ModelConfig, Status};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// 3 layers (sliding+hash, CSA+hash, HCA+top-k), 32x32 FP8 blocks: hidden 80 and q_lora 48
/// leave partial blocks at the right and bottom edges; FP4 rows of 80 and 48 leave partial
/// 1x32 scale blocks.
const CONFIG: &str = r#"{
  "vocab_size": 64, "hidden_size": 80, "num_hidden_layers": 3,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "qk_rope_head_dim": 16,
  "q_lora_rank": 48, "o_groups": 2, "o_lora_rank": 24, "sliding_window": 8,
  "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
  "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
  "mlp_layer_types": ["hash_moe", "hash_moe", "moe"],
  "index_n_heads": 2, "index_head_dim": 16, "index_topk": 2,
  "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 48,
  "hc_mult": 2,
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                          "weight_block_size": [32, 32], "activation_scheme": "dynamic"},
  "expert_dtype": "fp4"
}"#;

// ------------------------------------------------------------------------------------------
// Independent reference decoding (closed forms, not the library's tables)
// ------------------------------------------------------------------------------------------

fn e4m3(b: u8) -> f32 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 15) as i32;
    let m = (b & 7) as f32;
    if e == 0 {
        s * m / 8.0 * 2f32.powi(-6)
    } else {
        s * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

fn e8m0(b: u8) -> f32 {
    2f32.powi(b as i32 - 127)
}

fn e2m1(n: u8) -> f32 {
    let s = if n & 8 != 0 { -1.0 } else { 1.0 };
    let e = ((n >> 1) & 3) as i32;
    let m = (n & 1) as f32;
    if e == 0 {
        s * m * 0.5
    } else {
        s * (1.0 + m / 2.0) * 2f32.powi(e - 1)
    }
}

// ------------------------------------------------------------------------------------------
// A random model in its stored encodings, and the values it must load to
// ------------------------------------------------------------------------------------------

/// Quantised codes and their UE8M0 scales (`sshape`, row-major).
struct Codes {
    codes: Vec<u8>,
    scales: Vec<u8>,
    sshape: [usize; 2],
}

impl Codes {
    /// `codes` with random scales around 1 (UE8M0 exponents 118..=131) of shape `sshape`.
    fn with_random_scales(codes: Vec<u8>, sshape: [usize; 2], rng: &mut XorShift) -> Codes {
        let scales = (0..sshape[0] * sshape[1])
            .map(|_| 118 + rng.below(14) as u8)
            .collect();
        Codes {
            codes,
            scales,
            sshape,
        }
    }
}

enum Enc {
    /// Multiples of 1/64 in [-2, 2] (at most 8 significant bits): exact in F32, BF16 and F16.
    Plain(Vec<f32>),
    /// FP8 codes [out, in] and scales [ceil(out/bo), ceil(in/bi)].
    Fp8(Codes),
    /// Packed FP4 codes [out, in/2] (two per byte) and scales [out, ceil(in/32)].
    Fp4(Codes),
    Index(Vec<i64>),
}

struct Model {
    cfg: ModelConfig,
    specs: Vec<TensorSpec>,
    block: [usize; 2],
    enc: BTreeMap<String, Enc>,
}

#[derive(Debug, PartialEq)]
enum Expected {
    F32(Vec<u32>),
    I32(Vec<i32>),
}

impl Model {
    fn new(cfg_json: &str, seed: u64) -> Model {
        let cfg = ModelConfig::from_json_str(cfg_json).unwrap();
        let block = cfg.quant.as_ref().map_or([128, 128], |q| q.weight_block);
        let specs = tensor_specs(&cfg);
        let mut rng = XorShift(seed);
        let mut enc = BTreeMap::new();
        for s in &specs {
            let n = s.numel();
            let e = match (s.kind, s.stored) {
                (ElemKind::Index, _) => {
                    let e = cfg.n_routed_experts as u64;
                    let mut ids = Vec::with_capacity(n);
                    for _ in 0..s.shape[0] {
                        let mut row: Vec<i64> = Vec::new();
                        while row.len() < s.shape[1] {
                            let x = rng.below(e) as i64;
                            if !row.contains(&x) {
                                row.push(x);
                            }
                        }
                        ids.extend(row);
                    }
                    Enc::Index(ids)
                }
                (ElemKind::Float, StoredAs::Fp8Block) => {
                    let [o, i] = [s.shape[0], s.shape[1]];
                    let sshape = [o.div_ceil(block[0]), i.div_ceil(block[1])];
                    // Any code but the two NaNs; scales around 1.
                    let codes = (0..n).map(|_| {
                        loop {
                            let c = rng.next() as u8;
                            if c & 0x7F != 0x7F {
                                break c;
                            }
                        }
                    });
                    Enc::Fp8(Codes::with_random_scales(codes.collect(), sshape, &mut rng))
                }
                (ElemKind::Float, StoredAs::Fp4Expert) => {
                    let [o, i] = [s.shape[0], s.shape[1]];
                    let sshape = [o, i.div_ceil(32)];
                    let codes = (0..n / 2).map(|_| rng.next() as u8).collect();
                    Enc::Fp4(Codes::with_random_scales(codes, sshape, &mut rng))
                }
                (ElemKind::Float, StoredAs::Plain | StoredAs::Bf16Matrix) => Enc::Plain(
                    (0..n)
                        .map(|_| (rng.below(257) as f32 - 128.0) / 64.0)
                        .collect(),
                ),
            };
            enc.insert(s.name.clone(), e);
        }
        Model {
            cfg,
            specs,
            block,
            enc,
        }
    }

    fn spec(&self, name: &str) -> &TensorSpec {
        self.specs.iter().find(|s| s.name == name).unwrap()
    }

    /// Dequantised f32 values of a float weight (row-major logical shape).
    fn values(&self, name: &str) -> Vec<f32> {
        let s = self.spec(name);
        match &self.enc[name] {
            Enc::Plain(v) => v.clone(),
            Enc::Fp8(q) => {
                let i = s.shape[1];
                by_element(&s.shape, |r, c| {
                    let scale = q.scales[(r / self.block[0]) * q.sshape[1] + c / self.block[1]];
                    e4m3(q.codes[r * i + c]) * e8m0(scale)
                })
            }
            Enc::Fp4(q) => {
                let i = s.shape[1];
                by_element(&s.shape, |r, c| {
                    let b = q.codes[r * (i / 2) + c / 2];
                    let nib = if c % 2 == 0 { b & 15 } else { b >> 4 };
                    e2m1(nib) * e8m0(q.scales[r * q.sshape[1] + c / 32])
                })
            }
            Enc::Index(_) => panic!("{name} is an index table"),
        }
    }

    fn expected(&self) -> Vec<(String, Expected)> {
        self.specs
            .iter()
            .map(|s| {
                let e = match &self.enc[&s.name] {
                    Enc::Index(ids) => Expected::I32(ids.iter().map(|&x| x as i32).collect()),
                    _ => Expected::F32(self.values(&s.name).iter().map(|x| x.to_bits()).collect()),
                };
                (s.name.clone(), e)
            })
            .collect()
    }
}

/// The row-major [rows, cols] matrix whose element (r, c) is `f(r, c)`.
fn by_element(shape: &[usize], f: impl Fn(usize, usize) -> f32) -> Vec<f32> {
    let [o, i] = [shape[0], shape[1]];
    (0..o)
        .flat_map(|r| (0..i).map(move |c| (r, c)))
        .map(|(r, c)| f(r, c))
        .collect()
}

/// One tensor to write: (name, dtype, shape, bytes).
type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}
/// BF16 bytes (little-endian) as f32 values.
fn bf16_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect()
}
fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

/// Stores the release keeps in F32 (everything else plain is BF16 there).
fn is_f32_in_release(name: &str) -> bool {
    name.contains("hc_")
        || name.ends_with("attn_sink")
        || name.ends_with("ape")
        || name.ends_with("gate.bias")
}

/// An index table (tid2eid) as I64, the release dtype.
fn index_i64(name: String, shape: &[usize], ids: &[i64]) -> Entry {
    let bytes = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
    (name, Dtype::I64, shape.to_vec(), bytes)
}

/// A UE8M0 block-scale tensor, stored as its raw exponent bytes.
fn e8m0_scale(name: String, sshape: &[usize; 2], scales: &[u8]) -> Entry {
    (name, Dtype::F8_E8M0, sshape.to_vec(), scales.to_vec())
}

/// An FP8 weight as its two entries: `scale` (its block scales as the scheme stores them),
/// then the E4M3 codes.
fn fp8_entries(n: String, s: &TensorSpec, q: &Codes, scale: Entry) -> [Entry; 2] {
    [scale, (n, Dtype::F8_E4M3, s.shape.clone(), q.codes.clone())]
}

/// A packed FP4 expert weight as its two entries: the UE8M0 `.scale`, then the nibbles
/// [out, in/2] under `packed_dtype` (I8 in the release, U8 from save_pretrained).
fn fp4_entries(n: String, s: &TensorSpec, q: &Codes, packed_dtype: Dtype) -> [Entry; 2] {
    let packed_shape = vec![s.shape[0], s.shape[1] / 2];
    [
        e8m0_scale(n.replace(".weight", ".scale"), &q.sshape, &q.scales),
        (n, packed_dtype, packed_shape, q.codes.clone()),
    ]
}

/// Scheme (a): upstream names, release dtypes, `.scale` companions (F8_E8M0).
fn scheme_upstream(m: &Model) -> Vec<Entry> {
    let mut out = Vec::new();
    for s in &m.specs {
        let n = s.name.clone();
        match &m.enc[&n] {
            Enc::Plain(v) if is_f32_in_release(&n) => {
                out.push((n, Dtype::F32, s.shape.clone(), f32_bytes(v)))
            }
            Enc::Plain(v) => out.push((n, Dtype::BF16, s.shape.clone(), bf16_bytes(v))),
            Enc::Index(ids) => out.push(index_i64(n, &s.shape, ids)),
            Enc::Fp8(q) => {
                let scale = e8m0_scale(n.replace(".weight", ".scale"), &q.sshape, &q.scales);
                out.extend(fp8_entries(n, s, q, scale));
            }
            Enc::Fp4(q) => out.extend(fp4_entries(n, s, q, Dtype::I8)),
        }
    }
    out
}

/// Scheme (b) names: what transformers' `save_pretrained` writes by default.
fn save_pretrained_name(c: &str) -> String {
    match c {
        "embed.weight" => "model.embed_tokens.weight".into(),
        "head.weight" => "head.weight".into(),
        "hc_head_fn" | "hc_head_base" | "hc_head_scale" => format!("model.hc_head.hc_{}", &c[8..]),
        _ if c.ends_with(".attn.kv_norm.weight") => {
            format!("model.{}", c.replace(".attn.kv_norm.", ".attn.norm."))
        }
        _ => format!("model.{c}"),
    }
}

/// Scheme (b): save_pretrained names, plain as F16, FP8 scales as F32 `weight_scale_inv`,
/// FP4 scales as `.scale`, tid2eid I32.
fn scheme_save_pretrained(m: &Model) -> Vec<Entry> {
    let mut out = Vec::new();
    for s in &m.specs {
        let n = save_pretrained_name(&s.name);
        match &m.enc[&s.name] {
            Enc::Plain(v) => out.push((n, Dtype::F16, s.shape.clone(), f16_bytes(v))),
            Enc::Index(ids) => out.push((
                n,
                Dtype::I32,
                s.shape.clone(),
                ids.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
            )),
            Enc::Fp8(q) => {
                let f: Vec<f32> = q.scales.iter().map(|&b| e8m0(b)).collect();
                let scale_bytes = f32_bytes(&f);
                let scale = (
                    format!("{n}_scale_inv"),
                    Dtype::F32,
                    q.sshape.to_vec(),
                    scale_bytes,
                );
                out.extend(fp8_entries(n, s, q, scale));
            }
            Enc::Fp4(q) => out.extend(fp4_entries(n, s, q, Dtype::U8)),
        }
    }
    out
}

/// Scheme (c): HF-native names; FP8 weights alternately F8_E4M3 + E8M0 `weight_scale_inv`
/// and dequantised F32; fused experts: `gate_up_proj` as packed FP4 [E, 2I, D/2] with
/// `gate_up_proj_scale_inv`, `down_proj` as dequantised BF16 [E, D, I].
fn scheme_native(m: &Model) -> Vec<Entry> {
    let mut out = Vec::new();
    let mut fp8_count = 0;
    for s in &m.specs {
        let Some(n) = native_name(&s.name) else {
            continue;
        };
        match &m.enc[&s.name] {
            Enc::Plain(v) => out.push((n, Dtype::F32, s.shape.clone(), f32_bytes(v))),
            Enc::Index(ids) => out.push(index_i64(n, &s.shape, ids)),
            Enc::Fp8(q) => {
                fp8_count += 1;
                if fp8_count % 2 == 0 {
                    let scale = e8m0_scale(format!("{n}_scale_inv"), &q.sshape, &q.scales);
                    out.extend(fp8_entries(n, s, q, scale));
                } else {
                    out.push((
                        n,
                        Dtype::F32,
                        s.shape.clone(),
                        f32_bytes(&m.values(&s.name)),
                    ));
                }
            }
            Enc::Fp4(_) => unreachable!("experts have no native per-expert name"),
        }
    }
    let (e, i, d) = (m.cfg.n_routed_experts, m.cfg.moe_inter, m.cfg.hidden_size);
    for l in 0..m.cfg.num_layers {
        let (mut packed, mut scales, mut down) = (Vec::new(), Vec::new(), Vec::new());
        for x in 0..e {
            for w in ["w1", "w3"] {
                let Enc::Fp4(q) = &m.enc[&format!("layers.{l}.ffn.experts.{x}.{w}.weight")] else {
                    panic!("expert not FP4")
                };
                packed.extend_from_slice(&q.codes);
                scales.extend_from_slice(&q.scales);
            }
            down.extend(m.values(&format!("layers.{l}.ffn.experts.{x}.w2.weight")));
        }
        let p = format!("model.layers.{l}.mlp.experts");
        out.push((
            format!("{p}.gate_up_proj"),
            Dtype::I8,
            vec![e, 2 * i, d / 2],
            packed,
        ));
        out.push((
            format!("{p}.gate_up_proj_scale_inv"),
            Dtype::F8_E8M0,
            vec![e, 2 * i, d.div_ceil(32)],
            scales,
        ));
        out.push((
            format!("{p}.down_proj"),
            Dtype::BF16,
            vec![e, d, i],
            bf16_bytes(&down),
        ));
    }
    out
}

// ------------------------------------------------------------------------------------------
// Files and loading
// ------------------------------------------------------------------------------------------

fn serialize(entries: &[Entry]) -> Vec<u8> {
    let views: Vec<(String, TensorView)> = entries
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                TensorView::new(*d, s.clone(), b).unwrap_or_else(|e| panic!("{n}: {e}")),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn write_file(path: &Path, entries: &[Entry]) {
    std::fs::write(path, serialize(entries)).unwrap();
}

/// Writes `entries` as a single `model.safetensors` in a fresh dir.
fn single(tag: &str, entries: &[Entry]) -> TempDir {
    let d = TempDir::new(tag);
    write_file(&d.0.join("model.safetensors"), entries);
    d
}

fn load(cfg: &ModelConfig, path: &Path) -> dsv4::Result<WeightStore> {
    let mut store = WeightStore::allocate(cfg).unwrap();
    load_checkpoint(&mut store, cfg, path)?;
    Ok(store)
}

fn contents(store: &WeightStore) -> Vec<(String, Expected)> {
    store
        .tensors()
        .iter()
        .map(|t| {
            let e = match &t.data {
                TensorData::F32(v) => Expected::F32(v.iter().map(|x| x.to_bits()).collect()),
                TensorData::I32(v) => Expected::I32(v.clone()),
                // Quantized or BF16 storage: compare the exact dequantized values.
                TensorData::Bf16(_) | TensorData::Quant(_) => {
                    let i = store.index_of(&t.spec.name).unwrap();
                    let cols = *t.spec.shape.last().unwrap();
                    let mut row = vec![0.0f32; cols];
                    let mut bits = Vec::with_capacity(t.spec.numel());
                    for r in 0..t.spec.numel() / cols {
                        store.matrix(i).row_into(r, cols, &mut row);
                        bits.extend(row.iter().map(|x| x.to_bits()));
                    }
                    Expected::F32(bits)
                }
            };
            (t.spec.name.clone(), e)
        })
        .collect()
}

fn assert_matches(m: &Model, store: &WeightStore, what: &str) {
    let want = m.expected();
    let got = contents(store);
    assert_eq!(want.len(), got.len());
    for ((wn, w), (gn, g)) in want.iter().zip(&got) {
        assert_eq!(wn, gn);
        if w != g {
            if let (Expected::F32(a), Expected::F32(b)) = (w, g) {
                let k = a
                    .iter()
                    .zip(b.iter())
                    .position(|(x, y)| x != y)
                    .unwrap_or(0);
                panic!(
                    "{what}: weight `{wn}` differs from the reference at element {k}: want {} got {}",
                    f32::from_bits(a[k]),
                    f32::from_bits(b[k])
                );
            }
            panic!("{what}: weight `{wn}` differs from the reference");
        }
    }
}

/// Loading must fail with `status` and a message containing every needle.
fn expect_err(cfg: &ModelConfig, path: &Path, status: Status, needles: &[&str]) {
    let e = match load(cfg, path) {
        Ok(_) => panic!(
            "load of {} succeeded; expected {status:?} mentioning {needles:?}",
            path.display()
        ),
        Err(e) => e,
    };
    assert_eq!(e.status, status, "{}", e.message);
    println!("{e}");
    for n in needles {
        assert!(e.message.contains(n), "message lacks `{n}`: {}", e.message);
    }
}

/// Writes `entries` as a fresh single-file checkpoint; loading it must fail with
/// `Status::Tensor` and a message containing every needle.
fn expect_tensor_err(cfg: &ModelConfig, tag: &str, entries: &[Entry], needles: &[&str]) {
    let d = single(tag, entries);
    expect_err(cfg, &d.0, Status::Tensor, needles);
}

fn find<'a>(entries: &'a mut [Entry], name: &str) -> &'a mut Entry {
    entries
        .iter_mut()
        .find(|e| e.0 == name)
        .unwrap_or_else(|| panic!("no entry {name}"))
}

fn without(entries: &[Entry], names: &[&str]) -> Vec<Entry> {
    entries
        .iter()
        .filter(|e| !names.contains(&e.0.as_str()))
        .cloned()
        .collect()
}

// ------------------------------------------------------------------------------------------
// Tests
// ------------------------------------------------------------------------------------------

#[test]
fn three_schemes_load_bit_identically() {
    let m = Model::new(CONFIG, 0x1234_5678);
    let a = single("scheme-a", &scheme_upstream(&m));
    let b = single("scheme-b", &scheme_save_pretrained(&m));
    let c = single("scheme-c", &scheme_native(&m));
    let sa = load(&m.cfg, &a.0).unwrap();
    assert_matches(&m, &sa, "upstream");
    let sb = load(&m.cfg, &b.0.join("model.safetensors")).unwrap();
    assert_matches(&m, &sb, "save_pretrained");
    let sc = load(&m.cfg, &c.0).unwrap();
    assert_matches(&m, &sc, "hf-native");
    // The quantised paths were really exercised: ragged FP8 blocks and partial FP4 blocks.
    let wq_a = m.spec("layers.0.attn.wq_a.weight");
    assert_eq!(wq_a.shape, vec![48, 80]);
    assert!(matches!(
        &m.enc["layers.0.attn.wq_a.weight"],
        Enc::Fp8(Codes { sshape: [2, 3], .. })
    ));
    assert!(matches!(
        &m.enc["layers.2.ffn.experts.1.w2.weight"],
        Enc::Fp4(Codes {
            sshape: [80, 2],
            ..
        })
    ));
}

#[test]
fn default_block_is_128() {
    // Without quantization_config the FP8 scale blocks are 128x128.
    let cfg_json = CONFIG.replace(
        r#""quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                          "weight_block_size": [32, 32], "activation_scheme": "dynamic"},
  "expert_dtype": "fp4""#,
        r#""rms_norm_eps": 1e-6"#,
    );
    let m = Model::new(&cfg_json, 99);
    assert_eq!(m.block, [128, 128]);
    assert!(matches!(
        &m.enc["layers.0.attn.wq_b.weight"],
        Enc::Fp8(Codes { sshape: [1, 1], .. })
    ));
    let d = single("block128", &scheme_upstream(&m));
    assert_matches(&m, &load(&m.cfg, &d.0).unwrap(), "block 128");
}

#[test]
fn sharded_checkpoint() {
    let m = Model::new(CONFIG, 7);
    let entries = scheme_upstream(&m);
    let d = TempDir::new("sharded");
    // Round-robin over 3 shards: weights and their scales often land in different files.
    let mut shards: Vec<Vec<Entry>> = vec![Vec::new(); 3];
    let mut map = serde_json::Map::new();
    for (k, e) in entries.iter().enumerate() {
        let f = format!("model-{:05}-of-00003.safetensors", k % 3 + 1);
        map.insert(e.0.clone(), serde_json::Value::from(f));
        shards[k % 3].push(e.clone());
    }
    for (k, s) in shards.iter().enumerate() {
        write_file(
            &d.0.join(format!("model-{:05}-of-00003.safetensors", k + 1)),
            s,
        );
    }
    let index = |map: &serde_json::Map<String, serde_json::Value>| {
        let v = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
        std::fs::write(d.0.join("model.safetensors.index.json"), v.to_string()).unwrap();
    };
    index(&map);
    assert_matches(&m, &load(&m.cfg, &d.0).unwrap(), "sharded");
    assert_matches(
        &m,
        &load(&m.cfg, &d.0.join("model.safetensors.index.json")).unwrap(),
        "index path",
    );

    // Index entry pointing to a shard that lacks the tensor.
    let mut bad = map.clone();
    bad.insert(
        "embed.weight".into(),
        "model-00003-of-00003.safetensors".into(),
    );
    let holder = map["embed.weight"].as_str().unwrap().to_string();
    if holder != "model-00003-of-00003.safetensors" {
        index(&bad);
        expect_err(
            &m.cfg,
            &d.0,
            Status::Tensor,
            &["embed.weight", "model-00003-of-00003.safetensors"],
        );
    }
    // Index naming a missing shard.
    let mut bad = map.clone();
    bad.insert(
        "embed.weight".into(),
        "model-00009-of-00003.safetensors".into(),
    );
    index(&bad);
    expect_err(
        &m.cfg,
        &d.0,
        Status::Io,
        &["model-00009-of-00003.safetensors"],
    );
    // Malformed index.
    std::fs::write(
        d.0.join("model.safetensors.index.json"),
        "{\"weight_map\": 3}",
    )
    .unwrap();
    expect_err(
        &m.cfg,
        &d.0,
        Status::Format,
        &["model.safetensors.index.json"],
    );
    // A tensor in two shards.
    index(&map);
    let mut s2 = shards[1].clone();
    s2.push(shards[0][0].clone());
    write_file(&d.0.join("model-00002-of-00003.safetensors"), &s2);
    expect_err(
        &m.cfg,
        &d.0,
        Status::Tensor,
        &[
            &shards[0][0].0,
            "model-00001-of-00003",
            "model-00002-of-00003",
        ],
    );
}

#[test]
fn name_and_coverage_errors() {
    let m = Model::new(CONFIG, 11);
    let base = scheme_upstream(&m);
    let cfg = &m.cfg;
    let with = |extra: Entry| {
        let mut e = base.clone();
        e.push(extra);
        e
    };

    // Unknown name.
    let bogus = "layers.0.attn.bogus.weight";
    expect_tensor_err(
        cfg,
        "unknown",
        &with((bogus.into(), Dtype::F32, vec![2], vec![0; 8])),
        &["unknown tensor", bogus, "model.safetensors"],
    );

    // A name that exists in the scheme but not in this model (layer 5; compressor on a sliding layer).
    for extra in [
        "layers.5.attn_norm.weight",
        "layers.0.attn.compressor.norm.weight",
    ] {
        let e = with((extra.into(), Dtype::F32, vec![32], vec![0; 128]));
        expect_tensor_err(cfg, "no-such-weight", &e, &["unknown tensor", extra]);
    }

    // Missing tensors (and their count).
    let wq_b = ["layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale"];
    expect_tensor_err(
        cfg,
        "missing1",
        &without(&base, &wq_b),
        &["missing tensor `layers.1.attn.wq_b.weight`"],
    );
    let three = [
        "norm.weight",
        "layers.2.ffn.gate.bias",
        "layers.0.hc_ffn_fn",
    ];
    expect_tensor_err(
        cfg,
        "missing3",
        &without(&base, &three),
        &["missing tensor `norm.weight` (and 2 more)"],
    );

    // Duplicate: two names of one weight; fused experts next to per-expert tensors.
    let emb = base.iter().find(|e| e.0 == "embed.weight").unwrap().clone();
    expect_tensor_err(
        cfg,
        "dup",
        &with(("model.embed_tokens.weight".into(), emb.1, emb.2, emb.3)),
        &["duplicate", "embed.weight", "model.embed_tokens.weight"],
    );
    let (x, i, dd) = (cfg.n_routed_experts, cfg.moe_inter, cfg.hidden_size);
    let fused = "model.layers.2.mlp.experts.down_proj";
    expect_tensor_err(
        cfg,
        "dup-fused",
        &with((
            fused.into(),
            Dtype::F32,
            vec![x, dd, i],
            vec![0; x * dd * i * 4],
        )),
        &["duplicate", fused, "w2.weight"],
    );

    // MTP tensors are accepted and ignored.
    let mut e = with((
        "mtp.0.enorm.weight".into(),
        Dtype::BF16,
        vec![80],
        vec![0; 160],
    ));
    e.push(e8m0_scale("mtp.0.e_proj.scale".into(), &[3, 3], &[127; 9]));
    let d = single("mtp", &e);
    assert_matches(&m, &load(cfg, &d.0).unwrap(), "with mtp");
}

#[test]
fn dtype_shape_and_scale_errors() {
    let m = Model::new(CONFIG, 12);
    let base = scheme_upstream(&m);
    // (tag, how the upstream checkpoint is broken, what the Status::Tensor message names).
    type Edit = fn(&mut Vec<Entry>);
    let cases: &[(&str, Edit, &[&str])] = &[
        // Wrong shape of a plain weight.
        (
            "shape",
            |e| find(e, "layers.1.attn.compressor.wkv.weight").2 = vec![80, 64],
            &[
                "layers.1.attn.compressor.wkv.weight",
                "model.safetensors",
                "[80, 64]",
                "[64, 80]",
            ],
        ),
        // Wrong dtype for a float weight (I32 data of the right size).
        (
            "dtype",
            |e| find(e, "layers.0.hc_attn_base").1 = Dtype::I32,
            &["layers.0.hc_attn_base", "I32"],
        ),
        // Float dtype for the index table.
        (
            "dtype-index",
            |e| find(e, "layers.0.ffn.gate.tid2eid").1 = Dtype::F64,
            &["layers.0.ffn.gate.tid2eid", "F64"],
        ),
        // FP8 weight without its scale.
        (
            "noscale",
            |e| *e = without(e, &["layers.1.attn.wo_b.scale"]),
            &["layers.1.attn.wo_b.weight", "no scale"],
        ),
        // FP4 expert without its scale.
        (
            "noscale4",
            |e| *e = without(e, &["layers.0.ffn.experts.2.w3.scale"]),
            &["layers.0.ffn.experts.2.w3.weight"],
        ),
        // Mis-shaped scale (and mis-typed scale).
        (
            "scaleshape",
            |e| find(e, "layers.0.attn.wq_a.scale").2 = vec![3, 2],
            &["layers.0.attn.wq_a.scale", "[3, 2]", "[2, 3]"],
        ),
        (
            "scaledtype",
            |e| find(e, "layers.0.attn.wq_a.scale").1 = Dtype::U8,
            &["layers.0.attn.wq_a.scale", "U8"],
        ),
        (
            "scaleshape4",
            |e| {
                let t = find(e, "layers.2.ffn.experts.0.w1.scale");
                t.2 = vec![48, 2];
                t.3.truncate(96);
            },
            &["layers.2.ffn.experts.0.w1.scale", "[48, 3]"],
        ),
        // Packed FP4 with the wrong packed shape.
        (
            "fp4shape",
            |e| find(e, "layers.2.ffn.experts.0.w2.weight").2 = vec![48, 40],
            &["layers.2.ffn.experts.0.w2.weight", "[48, 40]", "[80, 24]"],
        ),
        // Scale for a tensor that is not stored quantised.
        (
            "scale-plain",
            |e| {
                let scale = "layers.0.ffn.gate.scale".into();
                e.push((scale, Dtype::F8_E8M0, vec![1, 3], vec![127; 3]));
            },
            &[
                "layers.0.ffn.gate.weight",
                "layers.0.ffn.gate.scale",
                "not stored quantised",
            ],
        ),
        // Scale whose weight is absent.
        (
            "orphan-scale",
            |e| *e = without(e, &["layers.1.attn.wq_b.weight"]),
            &["layers.1.attn.wq_b.scale"],
        ),
        // Duplicate scale (two spellings).
        (
            "dup-scale",
            |e| {
                let s = find(e, "layers.0.attn.wkv.scale").clone();
                e.push(("layers.0.attn.wkv.weight_scale_inv".into(), s.1, s.2, s.3));
            },
            &[
                "duplicate",
                "layers.0.attn.wkv.scale",
                "layers.0.attn.wkv.weight_scale_inv",
            ],
        ),
        // Out-of-range expert id in tid2eid.
        (
            "tid2eid",
            |e| {
                let t = find(e, "layers.1.ffn.gate.tid2eid");
                t.3[8 * 5..8 * 6].copy_from_slice(&4i64.to_le_bytes());
            },
            &["layers.1.ffn.gate.tid2eid", "value 4", "[2, 1]"],
        ),
    ];
    for (tag, edit, needles) in cases {
        let mut e = base.clone();
        edit(&mut e);
        expect_tensor_err(&m.cfg, tag, &e, needles);
    }
}

/// Packed FP4 needs an even number of columns: a config whose expert in-dim (moe_inter for
/// w2) is odd cannot take FP4 experts.
#[test]
fn fp4_odd_columns() {
    let cfg = ModelConfig::from_json_str(&CONFIG.replace(
        r#""moe_intermediate_size": 48"#,
        r#""moe_intermediate_size": 47"#,
    ))
    .unwrap();
    let e = vec![
        (
            "layers.0.ffn.experts.0.w2.weight".to_string(),
            Dtype::I8,
            vec![80, 23],
            vec![0u8; 80 * 23],
        ),
        (
            "layers.0.ffn.experts.0.w2.scale".to_string(),
            Dtype::F8_E8M0,
            vec![80, 2],
            vec![127u8; 160],
        ),
    ];
    let d = single("odd", &e);
    // FP4 storage of an odd input dimension is impossible: creating the store already fails.
    let e1 = WeightStore::allocate(&cfg)
        .err()
        .expect("odd FP4 dimension must be rejected");
    assert_eq!(e1.status, Status::Config);
    assert!(
        e1.message.contains("layers.0.ffn.experts.0.w2.weight"),
        "{}",
        e1.message
    );
    // With BF16 storage the loader itself rejects the odd FP4 source tensor.
    let mut store = WeightStore::allocate_with(&cfg, dsv4::WeightFormat::Bf16).unwrap();
    let e2 = load_checkpoint(&mut store, &cfg, &d.0).unwrap_err();
    assert_eq!(e2.status, Status::Tensor, "{}", e2.message);
    for n in ["layers.0.ffn.experts.0.w2.weight", "even"] {
        assert!(
            e2.message.contains(n),
            "message lacks `{n}`: {}",
            e2.message
        );
    }
}

#[test]
fn file_errors() {
    let m = Model::new(CONFIG, 13);
    let bytes = serialize(&scheme_upstream(&m));
    let d = TempDir::new("file-errors");
    let f = d.0.join("model.safetensors");
    // Missing path.
    expect_err(&m.cfg, &d.0.join("absent"), Status::Io, &["absent"]);
    // Empty directory.
    expect_err(&m.cfg, &d.0, Status::Io, &["no *.safetensors"]);
    // Truncated at many points: header length, header, data.
    for cut in [0, 5, 8, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&f, &bytes[..cut]).unwrap();
        expect_err(&m.cfg, &f, Status::Format, &["model.safetensors"]);
    }
    // Header JSON garbage.
    let mut bad = bytes.clone();
    bad[8] = b'[';
    std::fs::write(&f, &bad).unwrap();
    expect_err(&m.cfg, &d.0, Status::Format, &["model.safetensors"]);
    // The intact file still loads.
    std::fs::write(&f, &bytes).unwrap();
    assert_matches(&m, &load(&m.cfg, &f).unwrap(), "intact");
}

/// A failed load leaves weights unwritten (all checks run first), and the store usable.
#[test]
fn failed_load_then_good_load() {
    let m = Model::new(CONFIG, 14);
    let cfg = &m.cfg;
    let mut store = WeightStore::allocate(cfg).unwrap();
    let mut e = scheme_upstream(&m);
    find(&mut e, "head.weight").2 = vec![80, 64];
    let bad = single("bad-then-good", &e);
    assert!(load_checkpoint(&mut store, cfg, &bad.0).is_err());
    assert!(contents(&store).iter().all(|(_, c)| match c {
        Expected::F32(v) => v.iter().all(|&x| x == 0),
        Expected::I32(v) => v.iter().all(|&x| x == 0),
    }));
    let ptrs: Vec<*const u8> = store.tensors().iter().map(|t| t.data.as_ptr()).collect();
    let good = single("good", &scheme_upstream(&m));
    load_checkpoint(&mut store, cfg, &good.0).unwrap();
    assert_matches(&m, &store, "after failed load");
    // Loading writes in place: no weight moved.
    assert_eq!(
        ptrs,
        store
            .tensors()
            .iter()
            .map(|t| t.data.as_ptr())
            .collect::<Vec<_>>()
    );
}

/// The transformers-written fixtures (generated by tests/fixtures/make_fixtures.py) load with
/// no error, and a few tensors land where the name mapping says.
#[test]
fn hf_fixtures_load() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for (dir, kv_norm_name) in [
        ("tiny", "model.layers.0.attn.norm.weight"),
        ("tiny_native", "model.layers.0.self_attn.kv_norm.weight"),
    ] {
        let d = root.join(dir);
        if !d.join("model.safetensors").is_file() {
            println!(
                "note: {} not present; skipping the fixture load check",
                d.join("model.safetensors").display()
            );
            continue;
        }
        let cfg = ModelConfig::from_path(&d).unwrap();
        let store = load(&cfg, &d).unwrap_or_else(|e| panic!("fixture {dir}: {e}"));
        // Spot-check against the raw file: the main KV norm under its scheme-specific name.
        let raw = std::fs::read(d.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
        let t = st.tensor(kv_norm_name).unwrap();
        assert_eq!(t.dtype(), Dtype::BF16);
        let want = bf16_values(t.data());
        let got = store.f32(store.index_of("layers.0.attn.kv_norm.weight").unwrap());
        assert_eq!(got, want.as_slice(), "{dir}: kv_norm");
        if dir == "tiny_native" {
            // Fused experts: expert 1's w3 is rows I..2I of gate_up_proj[1].
            let t = st
                .tensor("model.layers.1.mlp.experts.gate_up_proj")
                .unwrap();
            let (i, dd) = (cfg.moe_inter, cfg.hidden_size);
            let all = bf16_values(t.data());
            let w3 = store.f32(store.index_of("layers.1.ffn.experts.1.w3.weight").unwrap());
            assert_eq!(w3, &all[(2 * i + i) * dd..(4 * i) * dd]);
        }
        let tid = store.i32(store.index_of("layers.0.ffn.gate.tid2eid").unwrap());
        assert!(
            tid.iter()
                .all(|&x| x >= 0 && (x as usize) < cfg.n_routed_experts)
        );
        println!("fixture {dir}: loaded {} weights", store.len());
    }
}
