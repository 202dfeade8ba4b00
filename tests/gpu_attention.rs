//! GPU op test of the attention, compressor and indexer kernel families (kernels/SPEC.md):
//! the device sequence batch_meta -> compress (main) -> compress (indexer keys) -> indexer ->
//! attention -> ring_update -> slot_len over chunked batches of several sequences in slots
//! (continuing and restarting state, positions crossing window and ratio boundaries),
//! compared BIT FOR BIT with the CPU reference `reference::attention::attention_core` in
//! exact and official numerics: o, seq_of, the indexer's selection, and the whole per-slot
//! state (ring, entries, indexer keys — decoded from their pages in the stored format of the
//! numerics, entries and keys through a scrambled block table — compressor pending/previous
//! rows, has_prev, slot_len). Every case runs twice, once on each compressor path
//! (`CompressPath::Serial`, `CompressPath::Windows`), against the same reference.
//!
//! Without a CUDA device the GPU test prints `skipped: no CUDA device`; the NVRTC compile
//! test runs wherever NVRTC is installed (else it prints its own skip line).

mod common;

use common::kv::scrambled_table;
use common::rng::XorShift;
use dsv4::config::{AttnKind, ModelConfig};
use dsv4::cuda::arena::{self, Arena, ArenaPlan};
use dsv4::cuda::kernels::attention::{self, Attention, AttentionArgs, BatchMeta, RingArgs};
use dsv4::cuda::kernels::compressor::{self, CompressArgs, CompressKind, CompressPath, Compressor};
use dsv4::cuda::kernels::indexer::{self, Indexer, IndexerArgs};
use dsv4::cuda::kv_pages::{KvFormat, KvPagesDev, KvRows};
use dsv4::cuda::registry::{KernelCache, KernelSource, nvrtc_version};
use dsv4::cuda::{Context, DevicePtr, OwnedStream, Registry};
use dsv4::model::batch::SeqRange;
use dsv4::model::rope;
use dsv4::reference::attention::{
    CompressorParams, CoreInputs, CoreParams, IndexerInputs, attention_core, select_entries,
};
use dsv4::reference::ops::inv_sqrt;
use dsv4::reference::precision::Prec;
use dsv4::state::{CompressorState, SlotState};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const FAMILIES: [&KernelSource; 3] = [&attention::SOURCE, &compressor::SOURCE, &indexer::SOURCE];

fn device_or_skip() -> Option<Context> {
    let ctx = common::gpu::device_or_skip()?;
    println!("device 0: {} ({})", ctx.info().name, ctx.info().arch);
    Some(ctx)
}

/// The three families compile with NVRTC for sm_90a without warnings and define every
/// listed entry point (no GPU needed).
#[test]
fn families_compile_for_sm_90a_without_warnings() {
    match nvrtc_version() {
        Ok(v) => println!("NVRTC {}.{}", v.0, v.1),
        Err(e) => {
            if std::env::var_os("CI").is_some() {
                panic!("CI is set, so NVRTC must be installed: {e}");
            }
            println!("skipped: NVRTC not found ({e})");
            return;
        }
    }
    let _l = lock();
    let logs = std::sync::Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = logs.clone();
    dsv4::log::set_sink(
        Some(Box::new(move |_, m| {
            sink.lock().unwrap().push(m.to_string())
        })),
        dsv4::log::Level::Info,
    );
    let mut failures = Vec::new();
    for fam in FAMILIES {
        match fam.compile("sm_90a") {
            Ok(cubin) => {
                common::gpu::assert_cubin_defines(fam, &cubin);
                println!("compiled {} ({} bytes)", fam.family, cubin.len());
            }
            Err(e) => failures.push(format!("{}: {e}", fam.family)),
        }
    }
    dsv4::log::set_sink(None, dsv4::log::Level::Warn);
    let logs = logs.lock().unwrap();
    for l in logs.iter() {
        println!("{l}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(
        !logs.iter().any(|l| l.contains("warning")),
        "NVRTC warnings (above)"
    );
}

/// The block tables the attention tests scramble their pages with are permutations that move
/// pages (no GPU needed).
#[test]
fn scrambled_tables_are_permutations() {
    for n in [0, 1, 3, 64, 7919, 3 * 7919, 1000] {
        let t = scrambled_table(n);
        let mut seen = vec![false; n];
        for &p in &t {
            assert!(!seen[p as usize], "{n} pages: page {p} twice");
            seen[p as usize] = true;
        }
        assert!(
            n < 3 || t.iter().enumerate().any(|(i, &p)| p as usize != i),
            "{n}"
        );
    }
}

// ------------------------------------------------------------------------------ set-up

/// A small config: sliding, CSA (ratio 4) and HCA layers.
fn config(
    hd: usize,
    heads: usize,
    window: usize,
    hca: usize,
    ihead: usize,
    topk: usize,
) -> ModelConfig {
    let json = format!(
        r#"{{
  "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
  "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 3,
  "num_attention_heads": {heads}, "num_key_value_heads": 1, "head_dim": {hd}, "qk_rope_head_dim": 64,
  "q_lora_rank": 32, "o_groups": 1, "o_lora_rank": 32, "sliding_window": {window},
  "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
  "compress_rates": {{"compressed_sparse_attention": 4, "heavily_compressed_attention": {hca}}},
  "mlp_layer_types": ["moe", "moe", "moe"],
  "index_n_heads": {ihead}, "index_head_dim": 128, "index_topk": {topk},
  "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
  "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 1.5, "norm_topk_prob": true,
  "hc_mult": 2, "hc_sinkhorn_iters": 4, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
  "rope_theta": 10000, "compress_rope_theta": 160000,
  "rope_scaling": {{"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                   "beta_fast": 32, "beta_slow": 1}},
  "max_position_embeddings": 4096, "num_nextn_predict_layers": 0, "tie_word_embeddings": false
}}"#
    );
    ModelConfig::from_json_str(&json).unwrap()
}

/// Batches of (slot, first position, length), in batch order.
type Script = Vec<Vec<(usize, usize, usize)>>;

/// One test scenario: a config, capacities and the batches to run.
struct Case {
    cfg: ModelConfig,
    max_seq_len: usize,
    slots: usize,
    script: Script,
    /// Print per-kernel times (synchronizing after each launch).
    timing: bool,
}

impl Case {
    /// [`short_script`] on `cfg` in 3 slots of 80 positions, untimed.
    fn short(cfg: ModelConfig) -> Case {
        Case {
            cfg,
            max_seq_len: 80,
            slots: 3,
            script: short_script(),
            timing: false,
        }
    }

    fn max_tokens(&self) -> usize {
        self.script
            .iter()
            .map(|b| b.iter().map(|s| s.2).sum::<usize>())
            .max()
            .unwrap()
    }
}

/// Prefill chunks, decodes, a restart of slot 1 at position 0 over stale state, positions
/// crossing every window and ratio boundary (max_seq_len 80).
fn short_script() -> Script {
    let mut b = vec![
        vec![(0, 0, 11), (2, 0, 5)],
        vec![(0, 11, 1), (1, 0, 19), (2, 5, 3)],
        vec![(2, 8, 23), (0, 12, 2)],
        vec![(0, 14, 1), (1, 19, 1), (2, 31, 1)],
        vec![(1, 0, 9), (0, 15, 26)],
        vec![(2, 32, 4), (1, 9, 1), (0, 41, 1)],
    ];
    for k in 0..6 {
        b.push(vec![(1, 10 + k, 1), (0, 42 + k, 1), (2, 36 + k, 1)]);
    }
    b.push(vec![(0, 48, 30), (1, 16, 7)]);
    b
}

/// Flash-like lengths (max_seq_len 4096): a 2500-token prefill next to a chunked one, then
/// decodes; hundreds of visible CSA entries (top-k over them) and HCA entries.
fn long_script() -> Script {
    let mut b = vec![
        vec![(0, 0, 2500), (1, 0, 300)],
        vec![(1, 300, 301), (0, 2500, 3)],
    ];
    for k in 0..3 {
        b.push(vec![(0, 2503 + k, 1), (1, 601 + k, 1)]);
    }
    b
}

/// Device buffers of one layer's run, carved from one arena.
struct Dev {
    _arena: Arena,
    positions: DevicePtr,
    query_start: DevicePtr,
    seq_slots: DevicePtr,
    seq_of: DevicePtr,
    q: DevicePtr,
    kv: DevicePtr,
    ca: DevicePtr,
    cz: DevicePtr,
    ia: DevicePtr,
    iz: DevicePtr,
    qi: DevicePtr,
    iw: DevicePtr,
    scores: DevicePtr,
    selected: DevicePtr,
    nsel: DevicePtr,
    o: DevicePtr,
    sinks: DevicePtr,
    inv_freq: DevicePtr,
    ape: DevicePtr,
    norm: DevicePtr,
    iape: DevicePtr,
    inorm: DevicePtr,
    ring: DevicePtr,
    entries: DevicePtr,
    ikeys: DevicePtr,
    /// The block table of entries and keys: a slot's pages in a scrambled order.
    table: DevicePtr,
    comp: [DevicePtr; 5],
    icomp: [DevicePtr; 5],
    slot_len: DevicePtr,
}

fn dev_buffers(ctx: &Context, case: &Case, ratio: usize) -> Dev {
    let cfg = &case.cfg;
    let (max_t, slots) = (case.max_tokens(), case.slots);
    let (h, hd, w, di, hi) = (
        cfg.num_heads,
        cfg.head_dim,
        cfg.sliding_window,
        cfg.index_head_dim,
        cfg.index_n_heads,
    );
    let maxe = case.max_seq_len / ratio.max(1);
    let topk = cfg.index_topk;
    let mut plan = ArenaPlan::new();
    let mut r = |name: &str, floats: usize| plan.reserve(name, floats.max(1) * 4, 256).unwrap();
    let ids = [
        r("positions", max_t),
        r("query_start", slots + 1),
        r("seq_slots", slots),
        r("seq_of", max_t),
        r("q", max_t * h * hd),
        r("kv", max_t * hd),
        r("ca", max_t * 2 * hd),
        r("cz", max_t * 2 * hd),
        r("ia", max_t * 2 * di),
        r("iz", max_t * 2 * di),
        r("qi", max_t * hi * di),
        r("iw", max_t * hi),
        r("scores", max_t * maxe),
        r("selected", max_t * topk),
        r("nsel", max_t),
        r("o", max_t * h * hd),
        r("sinks", h),
        r("inv_freq", cfg.rope_dim / 2),
        r("ape", ratio.max(1) * 2 * hd),
        r("norm", hd),
        r("iape", ratio.max(1) * 2 * di),
        r("inorm", di),
        // Paged state sized for f32 rows (the larger format); `r` counts floats.
        r(
            "ring",
            slots * rows(true, hd, 0).page_bytes() * KvRows::pages_for(w) / 4,
        ),
        r(
            "entries",
            slots * rows(true, hd, 0).page_bytes() * KvRows::pages_for(maxe) / 4,
        ),
        r(
            "ikeys",
            slots * rows(false, di, 0).page_bytes() * KvRows::pages_for(maxe) / 4,
        ),
        r("table", slots * KvRows::pages_for(maxe)),
        r("c.pend_a", slots * ratio * 2 * hd),
        r("c.pend_z", slots * ratio * 2 * hd),
        r("c.prev_a", slots * ratio * hd),
        r("c.prev_z", slots * ratio * hd),
        r("c.has_prev", slots),
        r("i.pend_a", slots * ratio * 2 * di),
        r("i.pend_z", slots * ratio * 2 * di),
        r("i.prev_a", slots * ratio * di),
        r("i.prev_z", slots * ratio * di),
        r("i.has_prev", slots),
        r("slot_len", slots),
    ];
    let a = Arena::from_plan(ctx, &plan).unwrap(); // zeroed, like fresh CPU slot state
    // Arena::new zeroes with cuMemsetD8, which is asynchronous to the host and runs on the
    // legacy stream, which a non-blocking stream does not wait for: without this the zeroing
    // can land after this test's uploads (seen on an H200: sinks read back as 0).
    ctx.synchronize().unwrap();
    let p: Vec<DevicePtr> = ids.iter().map(|&i| a.region(i)).collect();
    Dev {
        positions: p[0],
        query_start: p[1],
        seq_slots: p[2],
        seq_of: p[3],
        q: p[4],
        kv: p[5],
        ca: p[6],
        cz: p[7],
        ia: p[8],
        iz: p[9],
        qi: p[10],
        iw: p[11],
        scores: p[12],
        selected: p[13],
        nsel: p[14],
        o: p[15],
        sinks: p[16],
        inv_freq: p[17],
        ape: p[18],
        norm: p[19],
        iape: p[20],
        inorm: p[21],
        ring: p[22],
        entries: p[23],
        ikeys: p[24],
        table: p[25],
        comp: [p[26], p[27], p[28], p[29], p[30]],
        icomp: [p[31], p[32], p[33], p[34], p[35]],
        slot_len: p[36],
        _arena: a,
    }
}

/// f32 rows (exact numerics) of KV vectors (`kv`) or indexer keys, for sizing buffers.
fn rows(kv: bool, dim: usize, nope: usize) -> KvRows {
    if kv {
        KvRows::kv(KvFormat::F32, dim, nope)
    } else {
        KvRows::index_keys(KvFormat::F32, dim)
    }
}

struct Kernels {
    attn: Attention,
    comp: Compressor,
    idx: Indexer,
}

fn download<T: dsv4::cuda::arena::Pod + Default + Clone>(
    p: DevicePtr,
    n: usize,
    s: dsv4::cuda::BorrowedStream,
) -> Vec<T> {
    let mut v = vec![T::default(); n];
    arena::copy_to_host_sync(&mut v, p, s).unwrap();
    v
}

/// Bitwise comparison; returns the number of mismatches (printing the first few).
fn cmp_f32(what: &str, got: &[f32], want: &[f32]) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut bad = 0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() != w.to_bits() {
            bad += 1;
            if bad <= 5 {
                println!(
                    "MISMATCH {what}[{i}]: device {g:e} ({:#010x}), reference {w:e} ({:#010x})",
                    g.to_bits(),
                    w.to_bits()
                );
            }
        }
    }
    if bad > 0 {
        println!("{what}: {bad} of {} values differ", got.len());
    }
    bad
}

fn comp_state(sl: &SlotState, layer: usize, index: bool) -> &CompressorState {
    let l = &sl.layers[layer];
    if index {
        l.index_compressor.as_ref().unwrap()
    } else {
        l.compressor.as_ref().unwrap()
    }
}

fn cmp_i32(what: &str, got: &[i32], want: &[i32]) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let bad = got.iter().zip(want).filter(|(g, w)| g != w).count();
    if bad > 0 {
        println!("MISMATCH {what}: device {got:?}\n  reference {want:?}");
    }
    bad
}

/// Runs the script on one layer of `cfg` in one numerics mode; returns the mismatch count.
fn run_layer(
    ctx: &Context,
    k: &Kernels,
    case: &Case,
    layer: usize,
    official: bool,
    path: CompressPath,
    seed: u64,
) -> usize {
    let cfg = &case.cfg;
    let (max_t, nslots) = (case.max_tokens(), case.slots);
    let spec = cfg.layers[layer];
    let (h, hd, win) = (cfg.num_heads, cfg.head_dim, cfg.sliding_window);
    let (hi, di, topk) = (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk);
    let ratio = spec.ratio;
    let csa = spec.attn == AttnKind::Csa;
    let overlap = csa;
    let width = if overlap { 2 * hd } else { hd };
    let maxe = case.max_seq_len / ratio.max(1);
    let prec = Prec { official };
    let stream = OwnedStream::new(ctx).unwrap();
    let s = stream.borrow();
    let d = dev_buffers(ctx, case, ratio);
    let _g = ctx.enter().unwrap();
    let mut rng = XorShift(seed);
    // The state in the format of the numerics, entries and keys through a scrambled table.
    let format = KvFormat::for_official(official);
    let nope = cfg.nope_dim();
    let pps = KvRows::pages_for(maxe);
    let table = scrambled_table(nslots * pps);
    arena::copy_to_device_sync(d.table, &table, s).unwrap();
    let ring_pages = KvPagesDev {
        pool: d.ring,
        table: None,
        pages_per_slot: KvRows::pages_for(win),
        rows: KvRows::kv(format, hd, nope),
    };
    let entry_pages = KvPagesDev {
        pool: d.entries,
        table: Some(d.table),
        pages_per_slot: pps,
        rows: KvRows::kv(format, hd, nope),
    };
    let key_pages = KvPagesDev {
        pool: d.ikeys,
        rows: KvRows::index_keys(format, di),
        ..entry_pages
    };
    // Every slot's rows decoded from the device pool.
    let decoded = |pages: &KvPagesDev, count: usize| -> Vec<f32> {
        let pool: Vec<u8> = download(pages.pool, pages.pool.bytes(), s);
        (0..nslots)
            .flat_map(|slot| pages.decode_slot(&pool, pages.table.map(|_| &table[..]), slot, count))
            .collect()
    };

    // Weights.
    let freqs = rope::inv_freq(cfg, spec.attn);
    let sinks = rng.vec(h, 1.0, false);
    let ape = rng.vec(ratio.max(1) * width, 1.0, false);
    let norm: Vec<f32> = (0..hd).map(|_| 1.0 + rng.f(0.5)).collect();
    let iape = rng.vec(ratio.max(1) * 2 * di, 1.0, false);
    let inorm: Vec<f32> = (0..di).map(|_| 1.0 + rng.f(0.5)).collect();
    for (p, v) in [
        (d.sinks, &sinks),
        (d.inv_freq, &freqs),
        (d.ape, &ape),
        (d.norm, &norm),
        (d.iape, &iape),
        (d.inorm, &inorm),
    ] {
        arena::copy_to_device_sync(p, v, s).unwrap();
    }
    let params = CoreParams {
        cfg,
        spec,
        layer,
        freqs: &freqs,
        prec,
        sink: &sinks,
        compressor: (ratio > 0).then_some(CompressorParams {
            ape: &ape,
            norm: &norm,
        }),
        index_compressor: csa.then_some(CompressorParams {
            ape: &iape,
            norm: &inorm,
        }),
    };
    let mut slots: Vec<SlotState> = (0..nslots)
        .map(|_| SlotState::new(cfg, case.max_seq_len).unwrap())
        .collect();
    let mut slot_len = vec![0i32; nslots];
    let mut bad = 0;

    for (bi, batch) in case.script.iter().enumerate() {
        let tag = format!(
            "layer {layer} ({:?}) {} batch {bi}",
            spec.attn,
            if official { "official" } else { "exact" }
        );
        // Batch arrays as the host passes them.
        let mut positions = Vec::new();
        let mut query_start = vec![0i32];
        let mut seq_slots = Vec::new();
        let mut seqs = Vec::new();
        for &(slot, first, len) in batch {
            seqs.push(SeqRange {
                pad: false,
                slot,
                token_start: positions.len(),
                len,
                first_pos: first,
            });
            positions.extend((first..first + len).map(|p| p as i32));
            query_start.push(positions.len() as i32);
            seq_slots.push(slot as i32);
            if first == 0 {
                slots[slot].reset();
            }
        }
        let t = positions.len();
        assert!(t <= max_t);
        // Activations (BF16 values in official mode, as the pipeline produces them).
        let q = rng.vec(t * h * hd, 1.0, official);
        // (In official mode window KV rows reach attention FP8-simulated: what the ring stores.)
        let mut kv = rng.vec(t * hd, 1.0, official);
        prec.kv_nope_sim(&mut kv, hd, nope);
        let ca = rng.vec(t * width, 1.0, false);
        let cz = rng.vec(t * width, 2.0, false);
        let ia = rng.vec(t * 2 * di, 1.0, false);
        let iz = rng.vec(t * 2 * di, 2.0, false);
        let qi = rng.vec(t * hi * di, 1.0, official);
        let (s1, s2) = (inv_sqrt(di), inv_sqrt(hi));
        let iw: Vec<f32> = rng
            .vec(t * hi, 1.0, official)
            .iter()
            .map(|v| v * s1 * s2)
            .collect();

        // CPU reference.
        let inputs = CoreInputs {
            q: &q,
            kv: &kv,
            comp: (ratio > 0).then_some((&ca[..], &cz[..])),
            indexer: csa.then_some(IndexerInputs {
                a: &ia,
                z: &iz,
                qi: &qi,
                weights: &iw,
            }),
        };
        let o_ref = attention_core(&params, &inputs, &positions, &seqs, &mut slots);
        for sq in &seqs {
            slot_len[sq.slot] = (sq.first_pos + sq.len) as i32;
        }

        // Device.
        arena::copy_to_device_sync(d.positions, &positions, s).unwrap();
        arena::copy_to_device_sync(d.query_start, &query_start, s).unwrap();
        arena::copy_to_device_sync(d.seq_slots, &seq_slots, s).unwrap();
        for (p, v) in [
            (d.q, &q),
            (d.kv, &kv),
            (d.ca, &ca),
            (d.cz, &cz),
            (d.ia, &ia),
            (d.iz, &iz),
            (d.qi, &qi),
            (d.iw, &iw),
        ] {
            arena::copy_to_device_sync(p, v, s).unwrap();
        }
        for p in [d.o, d.seq_of, d.selected, d.nsel, d.scores] {
            arena::memset_async(p, 0xff, s).unwrap(); // NaN / -1 poison
        }
        let b = BatchMeta {
            positions: d.positions,
            query_start: d.query_start,
            seq_slots: d.seq_slots,
            seq_of: d.seq_of,
            num_tokens: t,
            num_seqs: batch.len(),
        };
        let time = |name: &str, f: &dyn Fn() -> dsv4::Result<()>| {
            if case.timing {
                s.synchronize().unwrap();
                let t0 = std::time::Instant::now();
                f().unwrap();
                s.synchronize().unwrap();
                println!(
                    "  {tag} ({t} tokens): {name} {:.3} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                );
            } else {
                f().unwrap();
            }
        };
        time("batch_meta", &|| k.attn.batch_meta(ctx, &b, s));
        if ratio > 0 {
            let c = CompressArgs {
                a: d.ca,
                z: d.cz,
                pend_a: d.comp[0],
                pend_z: d.comp[1],
                prev_a: Some(d.comp[2]),
                prev_z: Some(d.comp[3]),
                has_prev: Some(d.comp[4]),
                ape: d.ape,
                norm_w: d.norm,
                inv_freq: d.inv_freq,
                rope_dim: cfg.rope_dim,
                ratio,
                overlap,
                dc: hd,
                eps: cfg.rms_norm_eps,
                kind: CompressKind::Kv,
                nope: cfg.nope_dim(),
                official,
                entries: entry_pages,
                maxe,
                num_slots: nslots,
            };
            time("compress", &|| k.comp.compress_on(ctx, &b, &c, path, s));
            if csa {
                let ic = CompressArgs {
                    a: d.ia,
                    z: d.iz,
                    pend_a: d.icomp[0],
                    pend_z: d.icomp[1],
                    prev_a: Some(d.icomp[2]),
                    prev_z: Some(d.icomp[3]),
                    has_prev: Some(d.icomp[4]),
                    ape: d.iape,
                    norm_w: d.inorm,
                    dc: di,
                    overlap: true,
                    kind: CompressKind::IndexKey,
                    entries: key_pages,
                    ..c
                };
                time("compress (indexer keys)", &|| {
                    k.comp.compress_on(ctx, &b, &ic, path, s)
                });
                let ix = IndexerArgs {
                    qi: d.qi,
                    iw: d.iw,
                    ikeys: key_pages,
                    heads: hi,
                    dim: di,
                    ratio,
                    topk,
                    maxe,
                    num_slots: nslots,
                    official,
                    scores: d.scores,
                    selected: d.selected,
                    nsel: d.nsel,
                };
                time("indexer", &|| k.idx.select(ctx, &b, &ix, s));
            }
        }
        let x = AttentionArgs {
            q: d.q,
            q_bf16: None,
            kv: d.kv,
            ring: ring_pages,
            entries: (ratio > 0).then_some(entry_pages),
            selected: csa.then_some((d.selected, d.nsel)),
            sinks: d.sinks,
            heads: h,
            head_dim: hd,
            window: win,
            ratio,
            maxe: if ratio > 0 { maxe } else { 0 },
            topk,
            num_slots: nslots,
            official,
            o: d.o,
        };
        time("attention", &|| k.attn.attention(ctx, &b, &x, s));
        let ring_args = RingArgs {
            kv: d.kv,
            ring: ring_pages,
            window: win,
            head_dim: hd,
            num_slots: nslots,
            official,
        };
        time("ring_update", &|| {
            k.attn.ring_update(ctx, &b, &ring_args, s)
        });
        time("slot_len", &|| {
            k.attn.slot_len(ctx, &b, d.slot_len, nslots, s)
        });
        s.synchronize().unwrap();

        // Compare.
        let mut nb = 0;
        let seq_of_ref: Vec<i32> = seqs
            .iter()
            .enumerate()
            .flat_map(|(i, sq)| std::iter::repeat_n(i as i32, sq.len))
            .collect();
        nb += cmp_i32(
            &format!("{tag}: seq_of"),
            &download(d.seq_of, t, s),
            &seq_of_ref,
        );
        nb += cmp_f32(&format!("{tag}: o"), &download(d.o, t * h * hd, s), &o_ref);
        if csa {
            let sel: Vec<i32> = download(d.selected, t * topk, s);
            let nsel: Vec<i32> = download(d.nsel, t, s);
            for (si, sq) in seqs.iter().enumerate() {
                let ls = &slots[sq.slot].layers[layer];
                for i in sq.token_start..sq.token_start + sq.len {
                    let visible = (positions[i] as usize + 1) / ratio;
                    let want = select_entries(cfg, prec, &ls.index_keys, visible, &qi, &iw, i);
                    let mut want_row: Vec<i32> = want.iter().map(|&e| e as i32).collect();
                    want_row.resize(topk, -1);
                    nb += cmp_i32(
                        &format!("{tag}: seq {si} token {i} nsel"),
                        &nsel[i..i + 1],
                        &[want.len() as i32],
                    );
                    nb += cmp_i32(
                        &format!("{tag}: seq {si} token {i} selected"),
                        &sel[i * topk..(i + 1) * topk],
                        &want_row,
                    );
                }
            }
        }
        // State of every slot.
        let gather =
            |f: &dyn Fn(&SlotState) -> Vec<f32>| -> Vec<f32> { slots.iter().flat_map(f).collect() };
        nb += cmp_f32(
            &format!("{tag}: ring"),
            &decoded(&ring_pages, win),
            &gather(&|sl| sl.layers[layer].window.clone()),
        );
        if ratio > 0 {
            nb += cmp_f32(
                &format!("{tag}: entries"),
                &decoded(&entry_pages, maxe),
                &gather(&|sl| sl.layers[layer].entries.clone()),
            );
            let mut comps = vec![("compressor", d.comp, false)];
            if csa {
                comps.push(("index_compressor", d.icomp, true));
                nb += cmp_f32(
                    &format!("{tag}: index keys"),
                    &decoded(&key_pages, maxe),
                    &gather(&|sl| sl.layers[layer].index_keys.clone()),
                );
            }
            for (name, c, ix) in comps {
                let dc = if ix { di } else { hd };
                let w = if overlap { 2 * dc } else { dc };
                nb += cmp_f32(
                    &format!("{tag}: {name}.pend_a"),
                    &download(c[0], nslots * ratio * w, s),
                    &gather(&|sl| comp_state(sl, layer, ix).pending_a.clone()),
                );
                nb += cmp_f32(
                    &format!("{tag}: {name}.pend_z"),
                    &download(c[1], nslots * ratio * w, s),
                    &gather(&|sl| comp_state(sl, layer, ix).pending_z.clone()),
                );
                if overlap {
                    nb += cmp_f32(
                        &format!("{tag}: {name}.prev_a"),
                        &download(c[2], nslots * ratio * dc, s),
                        &gather(&|sl| comp_state(sl, layer, ix).prev_a.clone()),
                    );
                    nb += cmp_f32(
                        &format!("{tag}: {name}.prev_z"),
                        &download(c[3], nslots * ratio * dc, s),
                        &gather(&|sl| comp_state(sl, layer, ix).prev_z.clone()),
                    );
                    let hp_ref: Vec<i32> = slots
                        .iter()
                        .map(|sl| comp_state(sl, layer, ix).has_prev as i32)
                        .collect();
                    nb += cmp_i32(
                        &format!("{tag}: {name}.has_prev"),
                        &download(c[4], nslots, s),
                        &hp_ref,
                    );
                }
            }
        }
        nb += cmp_i32(
            &format!("{tag}: slot_len"),
            &download(d.slot_len, nslots, s),
            &slot_len,
        );
        if nb > 0 {
            println!("{tag}: {nb} mismatches");
        }
        bad += nb;
    }
    println!(
        "layer {layer} ({:?}, ratio {ratio}) {}: {} batches, {} mismatches",
        spec.attn,
        if official { "official" } else { "exact" },
        case.script.len(),
        bad
    );
    bad
}

fn run_case(name: &str, case: &Case, seed: u64) {
    let cfg = &case.cfg;
    let _l = lock();
    let Some(ctx) = device_or_skip() else { return };
    let families: Vec<&KernelSource> = FAMILIES.to_vec();
    let reg = Registry::load_families(&ctx, &families, &KernelCache::disabled())
        .unwrap_or_else(|e| panic!("{e}"));
    for kn in reg.kernels() {
        println!(
            "  {}::{}: {} regs, {} B static smem, {} B local, max dyn smem {}",
            kn.family, kn.name, kn.num_regs, kn.static_smem, kn.local_bytes, kn.max_dynamic_smem
        );
    }
    let k = Kernels {
        attn: Attention::new(&reg).unwrap(),
        comp: Compressor::new(&reg).unwrap(),
        idx: Indexer::new(&reg).unwrap(),
    };
    let mut bad = 0;
    for layer in 0..cfg.num_layers {
        for official in [false, true] {
            // Both compressor paths from the same seed: the same batches, the same reference.
            for path in [CompressPath::Serial, CompressPath::Windows] {
                println!("layer {layer}, official {official}, compressor {path:?}");
                bad += run_layer(
                    &ctx,
                    &k,
                    case,
                    layer,
                    official,
                    path,
                    seed + layer as u64 * 7919 + official as u64,
                );
            }
        }
    }
    assert_eq!(
        bad, 0,
        "{name}: the device disagrees with the CPU reference (see MISMATCH lines)"
    );
}

/// head_dim 128, 4 heads, window 8, CSA ratio 4 with 8 indexer heads and top-4, HCA ratio 8.
#[test]
fn attention_sequence_matches_reference_small() {
    let case = Case::short(config(128, 4, 8, 8, 8, 4));
    run_case("small", &case, 0x9e37_79b9_7f4a_7c15);
}

/// head_dim 512 (two channels per thread), 2 heads, window 16, CSA top-8 with 64 indexer
/// heads (large shared memory), HCA ratio 16.
#[test]
fn attention_sequence_matches_reference_wide() {
    let case = Case::short(config(512, 2, 16, 16, 64, 8));
    run_case("wide", &case, 0x1234_5678_9abc_def1);
}

/// Flash-like shapes and lengths: head_dim 512, window 128, CSA top-512 over up to 626
/// visible entries with 64 indexer heads, HCA ratio 128; a 2500-token prefill. Prints each
/// kernel's time.
#[test]
fn attention_sequence_matches_reference_long() {
    let case = Case {
        cfg: config(512, 2, 128, 128, 64, 512),
        max_seq_len: 4096,
        slots: 2,
        script: long_script(),
        timing: true,
    };
    run_case("long", &case, 0x0dd_b1a5_e5ba_d5e5);
}
