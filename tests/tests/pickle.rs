//! PyTorch pickle checkpoints (`pytorch_model.bin`, original DeiT `.pth`) go through candle's
//! pickle reader. torch is not available here, so the test writes the zip + pickle format
//! `torch.save` produces (protocol 2, `_rebuild_tensor_v2`, persistent storage ids, one raw
//! little-endian file per storage) by hand.

mod common;

use std::io::Write;
use std::path::Path;

use candle_core::{DType, Device, Module};
use common::*;
use models::{Checkpoint, WeightNaming};

fn global(out: &mut Vec<u8>, module: &str, name: &str) {
    out.push(b'c');
    out.extend_from_slice(format!("{module}\n{name}\n").as_bytes());
}

fn unicode(out: &mut Vec<u8>, s: &str) {
    out.push(b'X');
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn int(out: &mut Vec<u8>, v: usize) {
    out.push(b'J');
    out.extend_from_slice(&(v as i32).to_le_bytes());
}

fn int_tuple(out: &mut Vec<u8>, vs: &[usize]) {
    out.push(b'(');
    for &v in vs {
        int(out, v);
    }
    out.push(b't');
}

/// `OrderedDict()` followed by SETITEMS of the given tensors (storage keys "0", "1", ...).
fn state_dict(out: &mut Vec<u8>, tensors: &[(String, Raw)]) {
    global(out, "collections", "OrderedDict");
    out.extend_from_slice(b")R(");
    for (i, (name, raw)) in tensors.iter().enumerate() {
        unicode(out, name);
        global(out, "torch._utils", "_rebuild_tensor_v2");
        out.push(b'(');
        // persistent id: ('storage', FloatStorage, key, location, numel)
        out.push(b'(');
        unicode(out, "storage");
        global(out, "torch", "FloatStorage");
        unicode(out, &i.to_string());
        unicode(out, "cpu");
        int(out, raw.data.len());
        out.extend_from_slice(b"tQ");
        int(out, 0); // storage offset
        int_tuple(out, &raw.shape);
        let mut stride = vec![1; raw.shape.len()];
        for d in (0..raw.shape.len().saturating_sub(1)).rev() {
            stride[d] = stride[d + 1] * raw.shape[d + 1];
        }
        int_tuple(out, &stride);
        out.push(0x89); // requires_grad = False
        global(out, "collections", "OrderedDict");
        out.extend_from_slice(b")R"); // backward hooks
        out.extend_from_slice(b"tR");
    }
    out.push(b'u');
}

/// Writes a torch.save-style zip; `nest_under` wraps the state dict as `{key: state_dict}`.
fn write_pth(path: &Path, tensors: &[(String, Raw)], nest_under: Option<&str>) {
    let mut pkl = vec![0x80, 2];
    if let Some(key) = nest_under {
        pkl.extend_from_slice(b"}(");
        unicode(&mut pkl, key);
        state_dict(&mut pkl, tensors);
        pkl.push(b'u');
    } else {
        state_dict(&mut pkl, tensors);
    }
    pkl.push(b'.');
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    zip.start_file("archive/data.pkl", opts).unwrap();
    zip.write_all(&pkl).unwrap();
    for (i, (_, raw)) in tensors.iter().enumerate() {
        zip.start_file(format!("archive/data/{i}"), opts).unwrap();
        for v in &raw.data {
            zip.write_all(&v.to_le_bytes()).unwrap();
        }
    }
    zip.start_file("archive/version", opts).unwrap();
    zip.write_all(b"3\n").unwrap();
    zip.finish().unwrap();
}

#[test]
fn pytorch_checkpoints_load_like_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_cfg(false);
    let timm = random_timm_weights(&cfg, 1234);
    let st = dir.path().join("model.safetensors");
    save(&timm, &st);
    // transformers-style flat state dict in ViT names, and an original-DeiT-style .pth with the
    // timm state dict under "model".
    let bin = dir.path().join("pytorch_model.bin");
    write_pth(&bin, &to_hf(&timm, "vit"), None);
    let pth = dir.path().join("deit_tiny.pth");
    write_pth(&pth, &timm, Some("model"));

    let pixels = random_pixels(2, cfg.image_size, 99).tensor();
    let logits = |p: &Path, naming| {
        let ckpt = Checkpoint::from_file(p).unwrap();
        assert_eq!(ckpt.naming(), naming, "{p:?}");
        ckpt.load_model(&cfg, DType::F32, &Device::Cpu)
            .unwrap()
            .forward(&pixels)
            .unwrap()
    };
    let want = logits(&st, WeightNaming::Timm);
    assert_eq!(max_abs_diff(&logits(&bin, WeightNaming::HfVit), &want), 0.0);
    assert_eq!(max_abs_diff(&logits(&pth, WeightNaming::Timm), &want), 0.0);
}
