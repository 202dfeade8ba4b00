//! GPU op tests of the `moe` kernel family (kernels/moe.cu) against the CPU reference, BIT FOR
//! BIT: a whole MoE layer on the device (router -> plan -> act_quant -> up -> act_quant -> down,
//! shared expert through linear_kernel + swiglu_kernel, combine) against `reference::moe::moe`,
//! and the router against `reference::moe::route`, in exact and official numerics, on small
//! random configs (hash and top-k layers; sqrtsoftplus, sigmoid and softmax scoring; weights
//! stored F32, BF16, FP8 dense + FP4 experts, FP8 experts; ragged D and I; T up to 300 so plan
//! tiles span experts). The plan is checked against a CPU grouping, and repeated runs must agree
//! bit for bit (no order-dependent atomics).
//!
//! Inputs and weights are fresh random values each run (seed printed; `DSV4_TEST_SEED=<n>`
//! repeats one); outputs are poisoned with NaN first. Without a CUDA device every test prints
//! `skipped: no CUDA device` and returns.

mod common;

use common::assert_bits;
use common::gpu::{family_gpu, print_kernel_resources, weight_dev};
use common::rng::Rng;
use dsv4::ModelConfig;
use dsv4::cuda::arena::{self, ArenaPlan};
use dsv4::cuda::kernels::linear::{self, Linear, StorageFormat, WeightDev};
use dsv4::cuda::kernels::moe::{
    self, ExpertsDev, Moe, MoePlan, RouterParams, Selection, TILE_ROWS,
};
use dsv4::cuda::{Arena, BorrowedStream, Context, DevicePtr, OwnedStream};
use dsv4::model::{LayerWeights, ModelWeights};
use dsv4::reference::ops::Threads;
use dsv4::reference::precision::Prec;
use dsv4::weights::WeightFormat;
use dsv4::weights::qmatrix::QFormat;
use dsv4::weights::store::{TensorData, WeightStore};
use serde_json::{Value, json};
use std::sync::OnceLock;

const TH: Threads = Threads(4);

// ------------------------------------------------------------------------------ harness

struct Env {
    ctx: &'static Context,
    lin: Linear,
    moe: Moe,
}

/// The device, the `linear` and `moe` families compiled and loaded, and a
/// fresh stream for one test; or None after printing the skip line.
fn env() -> Option<(&'static Env, OwnedStream)> {
    static ENV: OnceLock<Env> = OnceLock::new();
    let g = family_gpu(&[&linear::SOURCE, &moe::SOURCE])?;
    let e = ENV.get_or_init(|| {
        print_kernel_resources(&g.reg);
        Env {
            ctx: &g.ctx,
            lin: Linear::new(&g.reg).unwrap(),
            moe: Moe::new(&g.reg).unwrap(),
        }
    });
    Some((e, OwnedStream::new(e.ctx).unwrap()))
}

/// Buffers in one arena, planned by name and size, uploaded after allocation.
#[derive(Default)]
struct Bufs {
    plan: ArenaPlan,
    init: Vec<(usize, Vec<u8>)>,
    n: usize,
}

impl Bufs {
    /// A buffer of `bytes` bytes (at least 4); returns its index.
    fn add(&mut self, bytes: usize) -> usize {
        self.plan
            .reserve(format!("b{}", self.n), bytes.max(4), 256)
            .unwrap();
        self.n += 1;
        self.n - 1
    }

    fn add_init(&mut self, data: Vec<u8>) -> usize {
        let i = self.add(data.len());
        self.init.push((i, data));
        i
    }

    /// Allocates and uploads; every buffer without initial data is poisoned with 0xff (NaN).
    fn alloc(self, ctx: &Context, s: BorrowedStream) -> (Arena, Vec<DevicePtr>) {
        let a = Arena::from_plan(ctx, &self.plan).unwrap();
        let ptrs: Vec<DevicePtr> = (0..self.n)
            .map(|i| a.find(&format!("b{i}")).unwrap())
            .collect();
        let _g = ctx.enter().unwrap();
        for p in &ptrs {
            arena::memset_async(*p, 0xff, s).unwrap();
        }
        for (i, d) in &self.init {
            arena::copy_to_device_sync(ptrs[*i], d, s).unwrap();
        }
        s.synchronize().unwrap();
        (a, ptrs)
    }
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn down<T: arena::Pod + Default>(p: DevicePtr, n: usize, s: BorrowedStream) -> Vec<T> {
    let mut v = vec![T::default(); n];
    arena::copy_to_host_sync(&mut v, p, s).unwrap();
    v
}

// ------------------------------------------------------------------------------ the layer

/// A weight matrix of the store in device form: its format, shape and raw bytes.
struct HostMat {
    format: StorageFormat,
    block: [usize; 2],
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    scales: Vec<f32>,
}

fn host_mat(store: &WeightStore, idx: usize) -> HostMat {
    let t = store.tensor(idx);
    let (rows, cols) = (t.spec.shape[0], t.spec.shape[1]);
    let (format, block, data, scales) = match &t.data {
        TensorData::F32(v) => (StorageFormat::F32, [0, 0], bytes_f32(v), vec![]),
        TensorData::Bf16(v) => (
            StorageFormat::Bf16,
            [0, 0],
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            vec![],
        ),
        TensorData::Quant(q) => {
            let block = match q.format {
                QFormat::Fp8 { block } => block,
                QFormat::Fp4 => [0, 0],
            };
            (
                StorageFormat::of_qformat(q.format),
                block,
                q.codes.clone(),
                q.scales.clone(),
            )
        }
        TensorData::I32(_) => panic!("{} is not a matrix", t.spec.name),
    };
    HostMat {
        format,
        block,
        rows,
        cols,
        data,
        scales,
    }
}

/// Planned buffers of one matrix (data, scales).
struct MatBufs {
    m: HostMat,
    data: usize,
    scales: usize,
}

fn plan_mat(b: &mut Bufs, m: HostMat) -> MatBufs {
    let data = b.add_init(m.data.clone());
    let scales = b.add_init(bytes_f32(&m.scales));
    MatBufs { m, data, scales }
}

fn dev_weight(mb: &MatBufs, p: &[DevicePtr]) -> WeightDev {
    let m = &mb.m;
    weight_dev(
        m.format,
        [m.rows, m.cols],
        m.block,
        (p[mb.data], m.data.len()),
        (p[mb.scales], m.scales.len() * 4),
    )
}

/// One MoE layer's weights on the device.
struct DevLayer {
    _arena: Arena,
    gate: DevicePtr,
    bias: Option<DevicePtr>,
    tid2eid: Option<DevicePtr>,
    /// w1, w2, w3 of the routed experts.
    experts: [ExpertsDev; 3],
    /// w1, w2, w3 of the shared expert.
    shared: Option<[WeightDev; 3]>,
}

fn upload_layer(
    e: &Env,
    s: BorrowedStream,
    cfg: &ModelConfig,
    store: &WeightStore,
    lw: &LayerWeights,
) -> DevLayer {
    let ne = cfg.n_routed_experts;
    let mut b = Bufs::default();
    let gate = b.add_init(bytes_f32(store.f32(lw.gate)));
    let bias = lw.gate_bias.map(|i| b.add_init(bytes_f32(store.f32(i))));
    let table = lw.tid2eid.map(|i| b.add_init(bytes_i32(store.i32(i))));
    let routed: Vec<[MatBufs; 3]> = lw
        .experts
        .iter()
        .map(|ew| [ew.w1, ew.w2, ew.w3].map(|i| plan_mat(&mut b, host_mat(store, i))))
        .collect();
    let shared = lw
        .shared
        .map(|sw| [sw.w1, sw.w2, sw.w3].map(|i| plan_mat(&mut b, host_mat(store, i))));
    // Pointer tables (data, scales) per projection, filled once addresses are known.
    let tables: [(usize, usize); 3] = [0, 1, 2].map(|_| (b.add(ne * 8), b.add(ne * 8)));
    let (arena, p) = b.alloc(e.ctx, s);
    let _g = e.ctx.enter().unwrap();
    let experts = [0usize, 1, 2].map(|j| {
        let ws: Vec<WeightDev> = routed.iter().map(|r| dev_weight(&r[j], &p)).collect();
        let addrs: Vec<u64> = ws.iter().map(|w| w.data.addr()).collect();
        let saddrs: Vec<u64> = ws
            .iter()
            .map(|w| w.scales.map_or(0, |x| x.addr()))
            .collect();
        let (tp, ts) = tables[j];
        arena::copy_to_device_sync(p[tp], &addrs, s).unwrap();
        arena::copy_to_device_sync(p[ts], &saddrs, s).unwrap();
        let w0 = ws[0];
        ExpertsDev {
            format: w0.format,
            ptrs: p[tp],
            scales: w0.format.is_quantized().then_some(p[ts]),
            block: w0.block,
            rows: w0.rows,
            cols: w0.cols,
            count: ne,
        }
    });
    DevLayer {
        gate: p[gate],
        bias: bias.map(|i| p[i]),
        tid2eid: table.map(|i| p[i]),
        experts,
        shared: shared.map(|sh| [0, 1, 2].map(|j| dev_weight(&sh[j], &p))),
        _arena: arena,
    }
}

/// Everything the device computed for one layer call.
struct GpuOut {
    ids: Vec<i32>,
    weights: Vec<f32>,
    offsets: Vec<i32>,
    rows: Vec<i32>,
    tiles: Vec<i32>,
    ntiles: i32,
    out: Vec<f32>,
}

/// The MoE layer on the device, step by step as the CUDA backend runs it.
#[allow(clippy::too_many_arguments)]
fn run_gpu(
    e: &Env,
    s: BorrowedStream,
    cfg: &ModelConfig,
    dl: &DevLayer,
    x: &[f32],
    tokens: &[i32],
    official: bool,
) -> GpuOut {
    let (d, i, k, ne) = (
        cfg.hidden_size,
        cfg.moe_inter,
        cfg.experts_per_tok,
        cfg.n_routed_experts,
    );
    let t = tokens.len();
    let n = t * k;
    let limit = cfg.swiglu_limit;
    let mut b = Bufs::default();
    let bx = b.add_init(bytes_f32(x));
    let btok = b.add_init(bytes_i32(tokens));
    let [ob, rb, tb, nb] = MoePlan::buffer_bytes(t, k, ne, TILE_ROWS);
    let sizes = [
        n * 4,     // ids
        n * 4,     // weights
        ob,        // offsets
        rb,        // rows
        tb,        // tiles
        nb,        // ntiles
        t * d * 4, // xq
        n * i * 4, // h
        n * i * 4, // hq
        n * d * 4, // ya
        t * d * 4, // xq (shared)
        t * i * 4, // g
        t * i * 4, // v
        t * i * 4, // hs
        t * i * 4, // hsq
        t * d * 4, // ys
        t * d * 4, // out
    ];
    let first = b.n;
    for sz in sizes {
        b.add(sz);
    }
    let (_arena, p) = b.alloc(e.ctx, s);
    let q = |j: usize, bytes: usize| p[first + j].slice(0, bytes).unwrap();
    let (ids, weights) = (q(0, n * 4), q(1, n * 4));
    let plan = MoePlan {
        offsets: q(2, ob),
        rows: q(3, rb),
        tiles: q(4, tb),
        ntiles: q(5, nb),
        tokens: t,
        k,
        experts: ne,
        tile_rows: TILE_ROWS,
    };
    let (xq, h, hq, ya) = (
        q(6, t * d * 4),
        q(7, n * i * 4),
        q(8, n * i * 4),
        q(9, n * d * 4),
    );
    let (xqs, g, v, hs, hsq) = (
        q(10, t * d * 4),
        q(11, t * i * 4),
        q(12, t * i * 4),
        q(13, t * i * 4),
        q(14, t * i * 4),
    );
    let (ys, out) = (q(15, t * d * 4), q(16, t * d * 4));
    let xd = p[bx].slice(0, t * d * 4).unwrap();
    let (ctx, lin, m) = (&e.ctx, &e.lin, &e.moe);

    let sel = match dl.tid2eid {
        Some(tab) => Selection::Hash {
            tid2eid: tab,
            tokens: p[btok],
            vocab: cfg.vocab_size,
        },
        None => Selection::TopK { bias: dl.bias },
    };
    m.router(
        ctx,
        xd,
        t,
        d,
        dl.gate,
        sel,
        &RouterParams::from_config(cfg),
        ids,
        weights,
        s,
    )
    .unwrap();
    m.plan(ctx, ids, &plan, s).unwrap();
    let [w1, w2, w3] = &dl.experts;
    let routed_q = w1.format.is_quantized();
    // What a linear of `rows` x `cols` activations reads: `x` FP8-quantized into `xq` first when
    // official numerics meet a quantized weight, else `x` itself.
    let act_in = |quantized: bool, x: DevicePtr, rows: usize, cols: usize, xq: DevicePtr| {
        if official && quantized {
            lin.act_quant(ctx, x, cols, rows, cols, xq, s).unwrap();
            xq
        } else {
            x
        }
    };
    let xin = act_in(routed_q, xd, t, d, xq);
    m.up(ctx, &plan, xin, w1, w3, weights, limit, official, h, s)
        .unwrap();
    let hin = act_in(routed_q, h, n, i, hq);
    m.down(ctx, &plan, hin, w2, official, ya, s).unwrap();
    let ys = dl.shared.as_ref().map(|[s1, s2, s3]| {
        let quant = s1.format.is_quantized();
        let xin = act_in(quant, xd, t, d, xqs);
        lin.linear(ctx, xin, d, t, s1, i, official, g, i, s)
            .unwrap();
        lin.linear(ctx, xin, d, t, s3, i, official, v, i, s)
            .unwrap();
        m.swiglu(ctx, g, v, t * i, limit, official, hs, s).unwrap();
        let hin = act_in(quant, hs, t, i, hsq);
        lin.linear(ctx, hin, i, t, s2, d, official, ys, d, s)
            .unwrap();
        ys
    });
    m.combine(ctx, ya, ys, t, k, d, official, out, s).unwrap();
    s.synchronize().unwrap();
    let nt: Vec<i32> = down(plan.ntiles, 1, s);
    GpuOut {
        ids: down(ids, n, s),
        weights: down(weights, n, s),
        offsets: down(plan.offsets, ne + 1, s),
        rows: down(plan.rows, n, s),
        tiles: down(plan.tiles, plan.max_tiles() * 3, s),
        ntiles: nt[0],
        out: down(out, t * d, s),
    }
}

/// The plan must group assignments by expert, stably, in tiles of at most TILE_ROWS rows.
fn check_plan(what: &str, g: &GpuOut, ne: usize) {
    let n = g.ids.len();
    let mut rows = Vec::with_capacity(n);
    let mut offsets = vec![0i32];
    let mut tiles = Vec::new();
    for ex in 0..ne as i32 {
        let start = rows.len();
        rows.extend((0..n as i32).filter(|&a| g.ids[a as usize] == ex));
        let c = rows.len() - start;
        for j in (0..c).step_by(TILE_ROWS) {
            tiles.extend([ex, (start + j) as i32, (c - j).min(TILE_ROWS) as i32]);
        }
        offsets.push(rows.len() as i32);
    }
    assert_eq!(g.offsets, offsets, "{what}: plan offsets");
    assert_eq!(g.rows, rows, "{what}: plan rows");
    assert_eq!(
        g.ntiles as usize,
        tiles.len() / 3,
        "{what}: plan tile count"
    );
    assert_eq!(&g.tiles[..tiles.len()], &tiles[..], "{what}: plan tiles");
}

// ------------------------------------------------------------------------------ configs

/// A small 2-layer model (layer 0 hash-routed, layer 1 top-k with bias; sliding attention only)
/// with `edits` applied to the embedded tiny config.
fn config(edits: &[(&str, Value)]) -> ModelConfig {
    let mut v: Value = serde_json::from_str(dsv4::config::TINY_DEFAULT_JSON).unwrap();
    let o = v.as_object_mut().unwrap();
    o.insert("num_hidden_layers".into(), json!(2));
    o.insert(
        "layer_types".into(),
        json!(["sliding_attention", "sliding_attention"]),
    );
    o.insert("mlp_layer_types".into(), json!(["hash_moe", "moe"]));
    o.insert("vocab_size".into(), json!(512));
    for (k, val) in edits {
        o.insert((*k).into(), val.clone());
    }
    ModelConfig::from_json_str(&v.to_string()).unwrap()
}

struct Variant {
    name: &'static str,
    edits: Vec<(&'static str, Value)>,
    format: WeightFormat,
}

fn variants() -> Vec<Variant> {
    let base = || {
        vec![
            ("hidden_size", json!(320)),
            ("moe_intermediate_size", json!(96)),
            ("n_routed_experts", json!(16)),
            ("num_experts_per_tok", json!(4)),
            ("swiglu_limit", json!(0.3)),
        ]
    };
    // The base sizes with `more` edits on top (an edit of a base key replaces it).
    let on_base = |more: Vec<(&'static str, Value)>| {
        let mut v = base();
        for (k, x) in more {
            v.retain(|(kk, _)| *kk != k);
            v.push((k, x));
        }
        v
    };
    // FP8 dense weights in `block` blocks, experts as `experts`.
    let quantized = |block: [usize; 2], experts: &str| {
        let q = json!({"weight_block_size": block, "expert_dtype": experts});
        ("quantization_config", q)
    };
    let variant = |name, format, edits| Variant {
        name,
        edits,
        format,
    };
    vec![
        variant("f32", WeightFormat::AsStored, base()),
        variant("bf16", WeightFormat::Bf16, base()),
        variant(
            "fp8 dense [32,64] + fp4 experts, D=326",
            WeightFormat::Quantize,
            on_base(vec![
                ("hidden_size", json!(326)),
                quantized([32, 64], "fp4"),
            ]),
        ),
        variant(
            "fp8 experts [64,128], I=90, k=3 of 12, no clamp",
            WeightFormat::Quantize,
            on_base(vec![
                ("moe_intermediate_size", json!(90)),
                ("n_routed_experts", json!(12)),
                ("num_experts_per_tok", json!(3)),
                ("swiglu_limit", json!(0.0)),
                quantized([64, 128], "fp8"),
            ]),
        ),
        variant(
            "sigmoid, no renorm, no shared expert",
            WeightFormat::AsStored,
            on_base(vec![
                ("scoring_func", json!("sigmoid")),
                ("norm_topk_prob", json!(false)),
                ("n_shared_experts", json!(0)),
            ]),
        ),
        variant(
            "softmax, fp8 [128,128] + fp4, tiny default sizes",
            WeightFormat::Quantize,
            vec![("scoring_func", json!("softmax"))],
        ),
    ]
}

// ------------------------------------------------------------------------------ tests

#[test]
fn moe_layer_matches_the_reference_bit_for_bit() {
    let Some((e, stream)) = env() else { return };
    let s = stream.borrow();
    let mut rng = Rng::from_env("moe");
    let mut runs = 0;
    for var in variants() {
        let cfg = config(&var.edits);
        let mut store = WeightStore::allocate_with(&cfg, var.format).unwrap();
        dsv4::weights::dummy::fill_dummy(&mut store, &cfg, rng.u64());
        let mw = ModelWeights::resolve(&cfg, store.table()).unwrap();
        for (l, lw) in mw.layers.iter().enumerate() {
            let dl = upload_layer(e, s, &cfg, &store, lw);
            let kind = if lw.tid2eid.is_some() {
                "hash"
            } else {
                "top-k"
            };
            for t in [1usize, 37, 300] {
                for official in [false, true] {
                    let what = format!(
                        "[{}] layer {l} ({kind}) T={t} {}",
                        var.name,
                        if official { "official" } else { "exact" }
                    );
                    let x: Vec<f32> = (0..t * cfg.hidden_size)
                        .map(|_| {
                            let v = rng.uniform(-2.0, 2.0);
                            if official {
                                half::bf16::from_f32(v).to_f32()
                            } else {
                                v
                            }
                        })
                        .collect();
                    let tokens: Vec<i32> = (0..t)
                        .map(|_| (rng.u64() % cfg.vocab_size as u64) as i32)
                        .collect();
                    let g = run_gpu(e, s, &cfg, &dl, &x, &tokens, official);

                    let (ids, weights) =
                        dsv4::reference::moe::route(&cfg, &store, lw, TH, &x, &tokens);
                    let ids: Vec<i32> = ids.iter().map(|&v| v as i32).collect();
                    assert_eq!(g.ids, ids, "{what}: router ids");
                    assert_bits(&format!("{what}: router weights"), &g.weights, &weights);
                    check_plan(&what, &g, cfg.n_routed_experts);
                    let want = dsv4::reference::moe::moe(
                        &cfg,
                        &store,
                        lw,
                        TH,
                        Prec { official },
                        &x,
                        &tokens,
                    );
                    assert_bits(&format!("{what}: MoE output"), &g.out, &want);
                    if t == 300 {
                        // Deterministic: a second run gives the same bits.
                        let g2 = run_gpu(e, s, &cfg, &dl, &x, &tokens, official);
                        assert_bits(&format!("{what}: rerun"), &g2.out, &g.out);
                        let spanning = (0..g.ntiles as usize)
                            .filter(|&i| g.tiles[3 * i + 2] as usize == TILE_ROWS)
                            .count();
                        println!("{what}: {} tiles ({spanning} full), bit-exact", g.ntiles);
                    }
                    runs += 1;
                }
            }
        }
    }
    println!("MoE layer: {runs} runs bit-exact");
}

/// The wide plan (three launches over many blocks) makes `moe_plan_kernel`'s offsets, rows and
/// tiles bit for bit, and both group the assignments as the host does: one block and many,
/// partial last blocks, ids outside [0, E) left out, a hot expert, 1 to 512 experts.
#[test]
fn wide_plan_equals_the_one_block_plan_bit_for_bit() {
    let Some((e, stream)) = env() else { return };
    let s = stream.borrow();
    let mut rng = Rng::from_env("moe wide plan");
    // (tokens, k, experts, tile_rows)
    let cases = [
        (1, 1, 1, 8),
        (170, 6, 40, 8),
        (1024, 1, 256, 128),
        (683, 3, 384, 16),
        (4096, 6, 256, 128),
        (4099, 6, 512, 64),
        (16384, 6, 256, 128),
    ];
    for (t, k, ne, tile_rows) in cases {
        let n = t * k;
        // Mostly uniform ids, a quarter on one hot expert, and 1 in 64 outside [0, E).
        let hot = rng.below(ne) as i32;
        let ids: Vec<i32> = (0..n)
            .map(|_| match rng.below(64) {
                0 => [-1, ne as i32, ne as i32 + 7, i32::MIN][rng.below(4)],
                1..=16 => hot,
                _ => rng.below(ne) as i32,
            })
            .collect();
        let [ob, rb, tb, nb] = MoePlan::buffer_bytes(t, k, ne, tile_rows);
        let [counts, ranks] = moe::plan_wide_scratch(n, ne);
        let mut b = Bufs::default();
        let id = b.add_init(bytes_i32(&ids));
        let one: Vec<usize> = [ob, rb, tb, nb].iter().map(|&x| b.add(x)).collect();
        let wide: Vec<usize> = [ob, rb, tb, nb].iter().map(|&x| b.add(x)).collect();
        let scratch = [b.add(counts * 4), b.add(ranks * 4)];
        let (_a, p) = b.alloc(e.ctx, s);
        let plan_at = |q: &[usize]| MoePlan {
            offsets: p[q[0]],
            rows: p[q[1]],
            tiles: p[q[2]],
            ntiles: p[q[3]],
            tokens: t,
            k,
            experts: ne,
            tile_rows,
        };
        let (p1, pw) = (plan_at(&one), plan_at(&wide));
        e.moe.plan(e.ctx, p[id], &p1, s).unwrap();
        let (c, r) = (p[scratch[0]], p[scratch[1]]);
        e.moe.plan_wide(e.ctx, p[id], &pw, c, r, s).unwrap();
        s.synchronize().unwrap();
        let what = format!("T {t} x k {k}, {ne} experts, tiles of {tile_rows}");
        // The host's grouping: stable by expert, then tiles in expert order.
        let mut rows = vec![];
        let mut offsets = vec![0i32];
        let mut tiles = vec![];
        for ex in 0..ne as i32 {
            let start = rows.len();
            rows.extend((0..n as i32).filter(|&a| ids[a as usize] == ex));
            let c = rows.len() - start;
            for j in (0..c).step_by(tile_rows) {
                tiles.extend([ex, (start + j) as i32, (c - j).min(tile_rows) as i32]);
            }
            offsets.push(rows.len() as i32);
        }
        for (name, q) in [("moe_plan_kernel", &p1), ("wide plan", &pw)] {
            let got_offsets: Vec<i32> = down(q.offsets, ne + 1, s);
            assert_eq!(got_offsets, offsets, "{what}: {name} offsets");
            let got_rows: Vec<i32> = down(q.rows, n, s);
            assert_eq!(&got_rows[..rows.len()], &rows[..], "{what}: {name} rows");
            let got_n: Vec<i32> = down(q.ntiles, 1, s);
            assert_eq!(got_n[0] as usize, tiles.len() / 3, "{what}: {name} tiles");
            let got_tiles: Vec<i32> = down(q.tiles, tiles.len().max(1), s);
            assert_eq!(
                &got_tiles[..tiles.len()],
                &tiles[..],
                "{what}: {name} tiles"
            );
        }
    }
}

#[test]
fn moe_wrappers_refuse_out_of_bounds_launches() {
    let Some((e, stream)) = env() else { return };
    let s = stream.borrow();
    let (t, k, ne) = (10usize, 2usize, 4usize);
    let [ob, rb, tb, nb] = MoePlan::buffer_bytes(t, k, ne, TILE_ROWS);
    let mut b = Bufs::default();
    for sz in [ob, rb, tb - 4, nb, t * k * 4, 64 * 4, tb] {
        b.add(sz);
    }
    let (_a, p) = b.alloc(e.ctx, s);
    let plan = MoePlan {
        offsets: p[0],
        rows: p[1],
        tiles: p[2],
        ntiles: p[3],
        tokens: t,
        k,
        experts: ne,
        tile_rows: TILE_ROWS,
    };
    assert!(
        e.moe.plan(e.ctx, p[4], &plan, s).is_err(),
        "tiles too small"
    );
    let plan_ok = MoePlan {
        tiles: p[6],
        ..plan
    };
    assert!(e.moe.plan(e.ctx, p[4], &plan_ok, s).is_ok());
    let rp = RouterParams {
        experts: 4,
        k: 5,
        scoring: dsv4::config::ScoringFunc::SqrtSoftplus,
        renorm: true,
        route_scale: 1.0,
    };
    let sel = Selection::TopK { bias: None };
    assert!(
        e.moe
            .router(e.ctx, p[5], 1, 16, p[5], sel, &rp, p[4], p[4], s)
            .is_err(),
        "k > E"
    );
    let rp = RouterParams { k: 2, ..rp };
    assert!(
        e.moe
            .router(e.ctx, p[5], 1, 16, p[5], sel, &rp, p[4], p[4], s)
            .is_ok()
    );
    assert!(
        e.moe
            .router(e.ctx, p[5], 1, 17, p[5], sel, &rp, p[4], p[4], s)
            .is_err(),
        "gate too small"
    );
    assert!(
        e.moe
            .combine(e.ctx, p[5], None, 2, 2, 17, false, p[5], s)
            .is_err(),
        "ya too small"
    );
    assert!(
        e.moe
            .swiglu(e.ctx, p[5], p[5], 65, 1.0, false, p[5], s)
            .is_err(),
        "n too large"
    );
    s.synchronize().unwrap();
}

// ------------------------------------------------------------------------------ benchmark

/// Time per call of each MoE step on DeepSeek-V4-Flash-like sizes (E=256, k=6, D=4096, I=2048,
/// FP4 experts; 32 distinct expert weight sets behind the 256 pointers). Not a correctness test:
/// run with `--ignored --nocapture` on a GPU.
#[test]
#[ignore = "benchmark: run with --ignored --nocapture on a GPU"]
fn moe_throughput() {
    let Some((e, stream)) = env() else { return };
    let s = stream.borrow();
    let mut rng = Rng::from_env("moe bench");
    let (ne, k, d, i, distinct) = (256usize, 6usize, 4096usize, 2048usize, 32usize);
    let tmax = 2048usize;
    let fmt = StorageFormat::Fp4;
    let mut b = Bufs::default();
    let mut rand_bytes = |n: usize| -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&rng.u64().to_le_bytes());
        }
        v.truncate(n);
        v
    };
    let mut mats = Vec::new(); // (data, scales) buffer indices per distinct expert, per projection
    for _ in 0..distinct {
        let mut m = Vec::new();
        for (r, c) in [(i, d), (d, i), (i, d)] {
            let data = b.add_init(rand_bytes(fmt.data_bytes(r, c)));
            let sc = vec![1.0f32 / 64.0; fmt.scale_count(r, c, [0, 0])];
            let scales = b.add_init(bytes_f32(&sc));
            m.push((data, scales));
        }
        mats.push(m);
    }
    let gate: Vec<f32> = (0..ne * d).map(|_| rng.uniform(-0.02, 0.02)).collect();
    let bias: Vec<f32> = (0..ne).map(|_| rng.uniform(-0.1, 0.1)).collect();
    let x: Vec<f32> = (0..tmax * d).map(|_| rng.uniform(-2.0, 2.0)).collect();
    let bg = b.add_init(bytes_f32(&gate));
    let bb = b.add_init(bytes_f32(&bias));
    let bx = b.add_init(bytes_f32(&x));
    let tables: Vec<(usize, usize)> = (0..3).map(|_| (b.add(ne * 8), b.add(ne * 8))).collect();
    let n = tmax * k;
    let [ob, rb, tb, nb] = MoePlan::buffer_bytes(tmax, k, ne, TILE_ROWS);
    let work: Vec<usize> = [
        n * 4,
        n * 4,
        ob,
        rb,
        tb,
        nb,
        tmax * d * 4,
        n * i * 4,
        n * i * 4,
        n * d * 4,
        tmax * d * 4,
    ]
    .iter()
    .map(|&sz| b.add(sz))
    .collect();
    let (_arena, p) = b.alloc(e.ctx, s);
    let _g = e.ctx.enter().unwrap();
    let experts: Vec<ExpertsDev> = (0..3)
        .map(|j| {
            let addrs: Vec<u64> = (0..ne).map(|x| p[mats[x % distinct][j].0].addr()).collect();
            let saddrs: Vec<u64> = (0..ne).map(|x| p[mats[x % distinct][j].1].addr()).collect();
            arena::copy_to_device_sync(p[tables[j].0], &addrs, s).unwrap();
            arena::copy_to_device_sync(p[tables[j].1], &saddrs, s).unwrap();
            let (rows, cols) = if j == 1 { (d, i) } else { (i, d) };
            ExpertsDev {
                format: fmt,
                ptrs: p[tables[j].0],
                scales: Some(p[tables[j].1]),
                block: [0, 0],
                rows,
                cols,
                count: ne,
            }
        })
        .collect();
    let w = |j: usize| p[work[j]];
    let time = |f: &mut dyn FnMut()| -> f64 {
        f();
        s.synchronize().unwrap();
        let mut iters = 0;
        let t0 = std::time::Instant::now();
        while iters < 3 || (t0.elapsed().as_secs_f64() < 0.2 && iters < 100) {
            f();
            iters += 1;
        }
        s.synchronize().unwrap();
        t0.elapsed().as_secs_f64() / iters as f64 * 1e6
    };
    let rp = RouterParams {
        experts: ne,
        k,
        scoring: dsv4::config::ScoringFunc::SqrtSoftplus,
        renorm: true,
        route_scale: 2.5,
    };
    let (ctx, m, lin) = (&e.ctx, &e.moe, &e.lin);
    for t in [1usize, 8, 64, 512, 2048] {
        let nt = t * k;
        let plan = MoePlan {
            offsets: w(2),
            rows: w(3),
            tiles: w(4),
            ntiles: w(5),
            tokens: t,
            k,
            experts: ne,
            tile_rows: TILE_ROWS,
        };
        let sel = Selection::TopK { bias: Some(p[bb]) };
        let xd = p[bx];
        let r = time(&mut || {
            m.router(ctx, xd, t, d, p[bg], sel, &rp, w(0), w(1), s)
                .unwrap()
        });
        let pl = time(&mut || m.plan(ctx, w(0), &plan, s).unwrap());
        let aq = time(&mut || lin.act_quant(ctx, xd, d, t, d, w(6), s).unwrap());
        let up = time(&mut || {
            m.up(
                ctx,
                &plan,
                w(6),
                &experts[0],
                &experts[2],
                w(1),
                10.0,
                true,
                w(7),
                s,
            )
            .unwrap()
        });
        let aqh = time(&mut || lin.act_quant(ctx, w(7), i, nt, i, w(8), s).unwrap());
        let dn = time(&mut || {
            m.down(ctx, &plan, w(8), &experts[1], true, w(9), s)
                .unwrap()
        });
        let cb = time(&mut || m.combine(ctx, w(9), None, t, k, d, true, w(10), s).unwrap());
        let flops = 2.0 * (nt * 3 * i * d) as f64;
        println!(
            "moe T={t}: router {r:.1} us, plan {pl:.1}, act_quant {aq:.1}, up {up:.1}, act_quant(h) {aqh:.1}, down {dn:.1}, combine {cb:.1}; experts {:.2} TF/s",
            flops / ((up + dn) * 1e-6) / 1e12
        );
    }
}
