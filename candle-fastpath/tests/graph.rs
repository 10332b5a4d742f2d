//! CapturedForward: a replayed graph gives exactly what the eager forward gives, for several
//! inputs, and returned outputs do not change under later replays. On CPU: a clear error.

mod common;

use candle_core::{DType, Tensor};
use candle_fastpath::{CapturedForward, FusedLinear};
use common::device;

/// A small network mixing cuBLASLt epilogues, candle's strided copies and broadcasts (whose
/// layout uploads must come from candle's capture cache) and a softmax.
fn forward(
    x: &Tensor,
    fc1: &FusedLinear,
    fc2: &FusedLinear,
    scale: &Tensor,
) -> candle_core::Result<Tensor> {
    let h = fc1.forward_gelu(x)?; // [B, T, 32]
    let h = h
        .transpose(1, 2)?
        .contiguous()?
        .transpose(1, 2)?
        .contiguous()?;
    let h = h.broadcast_mul(scale)?;
    let y = fc2.forward_residual(&h, x)?; // [B, T, 16]
    candle_nn::ops::softmax_last_dim(&y.mean(1)?)
}

/// Random weights for [`forward`] in `dtype`: fc1 (16 → 32), fc2 (32 → 16) and the scale.
fn layers(
    dev: &candle_core::Device,
    dtype: DType,
) -> candle_core::Result<(FusedLinear, FusedLinear, Tensor)> {
    let linear = |out: usize, inp: usize| -> candle_core::Result<FusedLinear> {
        Ok(FusedLinear::new(
            Tensor::randn(0f32, 0.3, (out, inp), dev)?.to_dtype(dtype)?,
            Some(Tensor::randn(0f32, 0.1, out, dev)?.to_dtype(dtype)?),
        )?)
    };
    let scale = Tensor::randn(1f32, 0.1, (1, 1, 32), dev)?.to_dtype(dtype)?;
    Ok((linear(32, 16)?, linear(16, 32)?, scale))
}

/// The capture on CUDA; elsewhere `None`, after checking that the error says why.
fn captured_or_cpu_error(
    captured: candle_fastpath::Result<CapturedForward>,
    dev: &candle_core::Device,
) -> Option<CapturedForward> {
    match captured {
        Ok(c) => Some(c),
        Err(e) => {
            assert!(!dev.is_cuda(), "capture failed on CUDA: {e}");
            assert!(e.to_string().contains("needs a CUDA device"), "{e}");
            None
        }
    }
}

#[test]
fn replay_equals_eager() -> anyhow::Result<()> {
    let dev = device();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (fc1, fc2, scale) = layers(&dev, dtype)?;
        let f = |x: &Tensor| forward(x, &fc1, &fc2, &scale);
        let example = Tensor::zeros((3, 5, 16), dtype, &dev)?;
        let Some(captured) = captured_or_cpu_error(CapturedForward::capture(&example, f), &dev)
        else {
            return Ok(());
        };
        let mut outputs = Vec::new();
        for seed in 0..3 {
            let x = (Tensor::randn(0f32, 1.0, (3, 5, 16), &dev)? + seed as f64)?.to_dtype(dtype)?;
            let eager = f(&x)?;
            let replayed = captured.run(&x)?;
            let diff = (eager.to_dtype(DType::F32)? - replayed.to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert_eq!(
                diff, 0.0,
                "{dtype:?} input {seed}: replay differs from eager by {diff}"
            );
            outputs.push((eager, replayed));
        }
        // Earlier results are copies: later replays did not overwrite them.
        for (eager, replayed) in &outputs {
            let diff = (eager.to_dtype(DType::F32)? - replayed.to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0);
        }
        // The wrong input shape is an error, not a replay on stale data.
        let wrong = Tensor::zeros((2, 5, 16), dtype, &dev)?;
        let e = captured.run(&wrong).unwrap_err();
        assert!(
            e.to_string()
                .contains("input has shape [2, 5, 16], expected [3, 5, 16]"),
            "{e}"
        );
    }
    Ok(())
}

#[test]
fn a_forward_that_reads_back_fails_the_capture_cleanly() -> anyhow::Result<()> {
    let dev = device();
    if !dev.is_cuda() {
        return Ok(());
    }
    let example = Tensor::ones((4, 8), DType::F32, &dev)?;
    // Reading a value back to the host inside the forward cannot be captured.
    let err = CapturedForward::capture(&example, |x| {
        let s = x.sum_all()?.to_scalar::<f32>()?;
        x.affine(s as f64, 0.0)
    })
    .unwrap_err();
    assert!(!err.to_string().is_empty());
    // The stream is still usable afterwards.
    let y = (example.clone() * 2.0)?.sum_all()?.to_scalar::<f32>()?;
    assert_eq!(y, 64.0);
    Ok(())
}

/// `capture_many`: two inputs of different dtypes (tokens and u32 row indices) and two outputs;
/// replays with new inputs equal the eager forward, and a wrong number of inputs is an error.
#[test]
fn several_inputs_and_outputs() -> anyhow::Result<()> {
    let dev = device();
    let f = |xs: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
        let picked = xs[0].index_select(&xs[1], 0)?;
        Ok(vec![(picked.exp()? * 2.0)?, xs[0].sum_keepdim(1)?])
    };
    let examples = [
        Tensor::zeros((6, 4), DType::F32, &dev)?,
        Tensor::new(&[0u32, 1, 2], &dev)?,
    ];
    let Some(captured) = captured_or_cpu_error(CapturedForward::capture_many(&examples, f), &dev)
    else {
        return Ok(());
    };
    for seed in 0..3u32 {
        let x = (Tensor::randn(0f32, 1.0, (6, 4), &dev)? + seed as f64)?;
        let idx = Tensor::new(&[5 - seed, seed, 3], &dev)?;
        let eager = f(&[x.clone(), idx.clone()])?;
        captured.replay_many(&[&x, &idx])?;
        assert_eq!(captured.outputs().len(), 2);
        for (e, r) in eager.iter().zip(captured.outputs()) {
            let diff = (e - r)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(
                diff, 0.0,
                "input {seed}: replay differs from eager by {diff}"
            );
        }
    }
    let e = captured.replay_many(&[&examples[0]]).unwrap_err();
    assert!(e.to_string().contains("1 inputs given"), "{e}");
    let e = captured
        .replay_many(&[&examples[0], &Tensor::new(&[0u32, 1], &dev)?])
        .unwrap_err();
    assert!(e.to_string().contains("expected [3]"), "{e}");
    Ok(())
}

/// The copies around a replay (the input into the graph's buffer, the outputs out of the
/// forward): sizes that are not whole 16-byte vectors and inputs at odd offsets (misaligned
/// views) arrive intact, in every float dtype, and a u8 input too.
#[test]
fn replay_copies_odd_sizes_and_offsets() -> anyhow::Result<()> {
    let dev = device();
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::U8] {
        for n in [1usize, 7, 1001, 4099] {
            let f = |x: &Tensor| -> candle_core::Result<Tensor> { Ok(x.clone()) };
            let example = Tensor::zeros(n, dtype, &dev)?;
            let Some(captured) = captured_or_cpu_error(CapturedForward::capture(&example, f), &dev)
            else {
                return Ok(());
            };
            for offset in [0usize, 1, 3, 8] {
                let big = Tensor::arange(0u32, (n + offset) as u32, &dev)?
                    .to_dtype(DType::F32)?
                    .affine(1.0, 0.5)?
                    .to_dtype(dtype)?;
                let input = big.narrow(0, offset, n)?;
                let got = captured.run(&input)?;
                let want = input.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                let got = got.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                assert_eq!(got, want, "{dtype:?} n {n} offset {offset}");
            }
        }
    }
    Ok(())
}

/// The node census of a captured graph counts what the forward launched: two candle kernels
/// (affine, sqr), the copies of the input into the graph's buffer (unless the switch puts it on
/// the stream) and of the output into the graph's, and a memory node pair per intermediate the
/// forward allocated and dropped inside the capture; the nodes form a chain.
#[test]
fn node_census_counts_the_forward() -> anyhow::Result<()> {
    let dev = device();
    let f = |x: &Tensor| -> candle_core::Result<Tensor> { x.affine(2.0, 1.0)?.sqr() };
    let example = Tensor::zeros(1000, DType::F32, &dev)?;
    let Some(captured) = captured_or_cpu_error(CapturedForward::capture(&example, f), &dev) else {
        return Ok(());
    };
    let nodes = captured.nodes()?;
    assert_eq!(nodes.kernels, 2, "{nodes}");
    let copies = if candle_fastpath::graph_input_copy_in_graph() {
        2
    } else {
        1
    };
    assert_eq!(nodes.memcpy, copies, "{nodes}");
    assert_eq!(nodes.memset + nodes.other, 0, "{nodes}");
    assert_eq!(nodes.mem_alloc, 2, "{nodes}");
    assert_eq!(nodes.mem_free, 2, "{nodes}");
    let total = nodes.kernels + nodes.memcpy + nodes.mem_alloc + nodes.mem_free;
    assert_eq!(nodes.edges, total - 1, "{nodes}");
    Ok(())
}

/// The graph copies its input itself (lever 123): a replay must read the input it is given
/// wherever that lives — the example again, new tensors, a strided view, a tensor at an address
/// an earlier input had — and give the eager forward's result each time.
#[test]
fn replays_follow_the_input_wherever_it_lives() -> anyhow::Result<()> {
    let dev = device();
    let dtype = DType::F16;
    let (fc1, fc2, scale) = layers(&dev, dtype)?;
    let f = |x: &Tensor| forward(x, &fc1, &fc2, &scale);
    let random = |shift: f64| -> anyhow::Result<Tensor> {
        Ok((Tensor::randn(0f32, 1.0, (3, 5, 16), &dev)? + shift)?.to_dtype(dtype)?)
    };
    let example = random(0.5)?;
    let Some(captured) = captured_or_cpu_error(CapturedForward::capture(&example, f), &dev) else {
        return Ok(());
    };
    let check = |x: &Tensor, what: &str| -> anyhow::Result<()> {
        let eager = f(x)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let replayed = captured
            .run(x)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert_eq!(replayed, eager, "{what}: replay differs from eager");
        Ok(())
    };
    // The example itself (the address captured), then a new tensor, then the example again.
    check(&example, "the example")?;
    let other = random(-1.0)?;
    check(&other, "a new tensor")?;
    check(&example, "the example again")?;
    // The example's storage rewritten in place: the graph reads it at replay time.
    let rewritten = random(2.0)?;
    example.inplace_op2(&rewritten, &CopyFrom)?;
    check(&example, "the example, rewritten")?;
    // A strided view (its contiguous copy is a temporary), and inputs made and dropped in a loop
    // (the allocator may hand a later one an earlier one's address).
    let wide = random(0.0)?
        .transpose(0, 1)?
        .contiguous()?
        .transpose(0, 1)?;
    assert!(!wide.is_contiguous());
    check(&wide, "a strided view")?;
    for i in 0..4 {
        check(&random(i as f64)?, &format!("loop input {i}"))?;
    }
    // A graph's own output buffer as the next input of another replay is read before it is
    // overwritten: feed the output (shape [3, 16]) of a graph over that shape back into it.
    let g = |x: &Tensor| x.affine(0.5, 1.0);
    let seed = Tensor::randn(0f32, 1.0, (3, 16), &dev)?;
    let chain = CapturedForward::capture(&seed, g)?;
    chain.replay(&seed)?;
    let mut want = g(&seed)?;
    for _ in 0..3 {
        chain.replay(&chain.output().clone())?;
        want = g(&want)?;
        assert_eq!(
            chain.output().flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?,
            "an output fed back as the input"
        );
    }
    Ok(())
}

/// `dst ← src` in place (test helper: rewrites a tensor's storage without a new allocation).
struct CopyFrom;

impl candle_core::InplaceOp2 for CopyFrom {
    fn name(&self) -> &'static str {
        "test-copy-from"
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("test-copy-from: CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        ld: &candle_core::Layout,
        src: &candle_core::CudaStorage,
        ls: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        assert!(ld.is_contiguous() && ls.is_contiguous());
        let n = ld.shape().elem_count();
        let s = src
            .as_cuda_slice::<half::f16>()?
            .slice(ls.start_offset()..ls.start_offset() + n);
        let mut d = dst
            .as_cuda_slice_mut::<half::f16>()?
            .slice_mut(ld.start_offset()..ld.start_offset() + n);
        src.device
            .cuda_stream()
            .memcpy_dtod(&s, &mut d)
            .map_err(candle_core::Error::wrap)
    }
}
