//! Test helpers: random DeiT weights in timm naming, independent renaming to the two
//! transformers namings (written from the transformers modeling files, not from the library's
//! mapping), and a plain-f64 reference forward pass.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use models::DeiTConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A tensor as plain data: shape and row-major f32 values.
#[derive(Debug, Clone)]
pub struct Raw {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Raw {
    pub fn tensor(&self) -> Tensor {
        Tensor::from_vec(self.data.clone(), self.shape.clone(), &Device::Cpu).unwrap()
    }
}

fn uniform(rng: &mut StdRng, shape: &[usize], center: f32, half_width: f32) -> Raw {
    let n = shape.iter().product();
    let data = (0..n)
        .map(|_| center + rng.random_range(-half_width..half_width))
        .collect();
    Raw {
        shape: shape.to_vec(),
        data,
    }
}

/// Random weights for `cfg` under timm names. Linear weights are scaled ~1/sqrt(fan_in) so
/// activations stay O(1) through the blocks (so the reference comparison is meaningful).
pub fn random_timm_weights(cfg: &DeiTConfig, seed: u64) -> Vec<(String, Raw)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (c, h, k, p) = (
        cfg.dim,
        cfg.dim * cfg.mlp_ratio,
        cfg.num_classes,
        cfg.patch_size,
    );
    let lin = |rng: &mut StdRng, out: usize, inp: usize| {
        let s = (3.0 / inp as f32).sqrt();
        (
            uniform(rng, &[out, inp], 0.0, s),
            uniform(rng, &[out], 0.0, 0.1),
        )
    };
    let mut w: Vec<(String, Raw)> = Vec::new();
    w.push(("cls_token".into(), uniform(&mut rng, &[1, 1, c], 0.0, 1.0)));
    if cfg.distilled {
        w.push(("dist_token".into(), uniform(&mut rng, &[1, 1, c], 0.0, 1.0)));
    }
    w.push((
        "pos_embed".into(),
        uniform(&mut rng, &[1, cfg.seq_len(), c], 0.0, 0.5),
    ));
    let s = (3.0 / (3 * p * p) as f32).sqrt();
    w.push((
        "patch_embed.proj.weight".into(),
        uniform(&mut rng, &[c, 3, p, p], 0.0, s),
    ));
    w.push((
        "patch_embed.proj.bias".into(),
        uniform(&mut rng, &[c], 0.0, 0.1),
    ));
    for i in 0..cfg.depth {
        let b = format!("blocks.{i}");
        w.push((
            format!("{b}.norm1.weight"),
            uniform(&mut rng, &[c], 1.0, 0.3),
        ));
        w.push((format!("{b}.norm1.bias"), uniform(&mut rng, &[c], 0.0, 0.3)));
        let (qw, qb) = lin(&mut rng, 3 * c, c);
        w.push((format!("{b}.attn.qkv.weight"), qw));
        w.push((format!("{b}.attn.qkv.bias"), qb));
        let (pw, pb) = lin(&mut rng, c, c);
        w.push((format!("{b}.attn.proj.weight"), pw));
        w.push((format!("{b}.attn.proj.bias"), pb));
        w.push((
            format!("{b}.norm2.weight"),
            uniform(&mut rng, &[c], 1.0, 0.3),
        ));
        w.push((format!("{b}.norm2.bias"), uniform(&mut rng, &[c], 0.0, 0.3)));
        let (f1w, f1b) = lin(&mut rng, h, c);
        w.push((format!("{b}.mlp.fc1.weight"), f1w));
        w.push((format!("{b}.mlp.fc1.bias"), f1b));
        let (f2w, f2b) = lin(&mut rng, c, h);
        w.push((format!("{b}.mlp.fc2.weight"), f2w));
        w.push((format!("{b}.mlp.fc2.bias"), f2b));
    }
    w.push(("norm.weight".into(), uniform(&mut rng, &[c], 1.0, 0.3)));
    w.push(("norm.bias".into(), uniform(&mut rng, &[c], 0.0, 0.3)));
    let (hw, hb) = lin(&mut rng, k, c);
    w.push(("head.weight".into(), hw));
    w.push(("head.bias".into(), hb));
    if cfg.distilled {
        let (hw, hb) = lin(&mut rng, k, c);
        w.push(("head_dist.weight".into(), hw));
        w.push(("head_dist.bias".into(), hb));
    }
    w
}

/// Rows `[i*n, (i+1)*n)` of a `[3n, ...]` tensor (q, k or v out of timm's fused qkv).
fn third(raw: &Raw, i: usize) -> Raw {
    let n = raw.shape[0] / 3;
    let row: usize = raw.shape[1..].iter().product();
    let mut shape = raw.shape.clone();
    shape[0] = n;
    Raw {
        shape,
        data: raw.data[i * n * row..(i + 1) * n * row].to_vec(),
    }
}

/// Renames timm weights to transformers' `ViTForImageClassification` (`prefix = "vit"`) or
/// `DeiTForImageClassificationWithTeacher` (`prefix = "deit"`) names, splitting qkv.
/// Names follow transformers' modeling_vit.py / modeling_deit.py.
pub fn to_hf(timm: &[(String, Raw)], prefix: &str) -> Vec<(String, Raw)> {
    let mut out = Vec::new();
    for (name, raw) in timm {
        let new = match name.as_str() {
            "cls_token" => format!("{prefix}.embeddings.cls_token"),
            "dist_token" => format!("{prefix}.embeddings.distillation_token"),
            "pos_embed" => format!("{prefix}.embeddings.position_embeddings"),
            "patch_embed.proj.weight" => {
                format!("{prefix}.embeddings.patch_embeddings.projection.weight")
            }
            "patch_embed.proj.bias" => {
                format!("{prefix}.embeddings.patch_embeddings.projection.bias")
            }
            "norm.weight" => format!("{prefix}.layernorm.weight"),
            "norm.bias" => format!("{prefix}.layernorm.bias"),
            "head.weight" if prefix == "vit" => "classifier.weight".into(),
            "head.bias" if prefix == "vit" => "classifier.bias".into(),
            "head.weight" => "cls_classifier.weight".into(),
            "head.bias" => "cls_classifier.bias".into(),
            "head_dist.weight" => "distillation_classifier.weight".into(),
            "head_dist.bias" => "distillation_classifier.bias".into(),
            n => {
                let rest = n.strip_prefix("blocks.").expect("block tensor");
                let (i, leaf) = rest.split_once('.').unwrap();
                let l = format!("{prefix}.encoder.layer.{i}");
                if let Some(param) = leaf.strip_prefix("attn.qkv.") {
                    for (j, m) in ["query", "key", "value"].iter().enumerate() {
                        out.push((
                            format!("{l}.attention.attention.{m}.{param}"),
                            third(raw, j),
                        ));
                    }
                    continue;
                }
                let (module, param) = leaf.rsplit_once('.').unwrap();
                let m = match module {
                    "norm1" => "layernorm_before",
                    "norm2" => "layernorm_after",
                    "attn.proj" => "attention.output.dense",
                    "mlp.fc1" => "intermediate.dense",
                    "mlp.fc2" => "output.dense",
                    other => panic!("unexpected {other}"),
                };
                format!("{l}.{m}.{param}")
            }
        };
        out.push((new, raw.clone()));
    }
    out
}

pub fn to_tensors(w: &[(String, Raw)]) -> HashMap<String, Tensor> {
    w.iter().map(|(n, r)| (n.clone(), r.tensor())).collect()
}

pub fn save(w: &[(String, Raw)], path: &Path) {
    candle_core::safetensors::save(&to_tensors(w), path).unwrap();
}

/// A tiny config going through the same code as the real ones.
pub fn tiny_cfg(distilled: bool) -> DeiTConfig {
    let mut c = DeiTConfig::custom(48, 2, 3, 10, distilled);
    c.name = "tiny-test".into();
    c
}

/// Random pixels `[b, 3, s, s]` in [-2, 2].
pub fn random_pixels(b: usize, s: usize, seed: u64) -> Raw {
    uniform(&mut StdRng::seed_from_u64(seed), &[b, 3, s, s], 0.0, 2.0)
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Reference forward pass: plain f64 loops, one image / token / head at a time.
// ---------------------------------------------------------------------------------------------

struct W<'a>(HashMap<&'a str, &'a Raw>);

impl W<'_> {
    fn get(&self, name: &str) -> Vec<f64> {
        self.0[name].data.iter().map(|&v| v as f64).collect()
    }
}

fn layer_norm(x: &[f64], g: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    x.iter()
        .zip(g.iter().zip(b))
        .map(|(v, (g, b))| (v - mean) * inv * g + b)
        .collect()
}

/// y = W x + b with W `[out, in]` row-major.
fn linear(x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let inp = x.len();
    (0..b.len())
        .map(|o| b[o] + (0..inp).map(|i| w[o * inp + i] * x[i]).sum::<f64>())
        .collect()
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))
}

fn softmax(x: &[f64]) -> Vec<f64> {
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// Logits `[B][num_classes]` of a DeiT with timm-named `weights` on `pixels` `[B, 3, S, S]`.
pub fn reference_logits(
    cfg: &DeiTConfig,
    weights: &[(String, Raw)],
    pixels: &Raw,
) -> Vec<Vec<f64>> {
    let w = W(weights.iter().map(|(n, r)| (n.as_str(), r)).collect());
    let (bsz, s, p, c) = (pixels.shape[0], pixels.shape[2], cfg.patch_size, cfg.dim);
    let g = s / p;
    let px = |b: usize, ch: usize, y: usize, x: usize| {
        pixels.data[((b * 3 + ch) * s + y) * s + x] as f64
    };
    let pw = w.get("patch_embed.proj.weight");
    let pb = w.get("patch_embed.proj.bias");
    let pos = w.get("pos_embed");
    let heads = cfg.heads;
    let hd = c / heads;
    let mut out = Vec::new();
    for b in 0..bsz {
        // Tokens: cls, (dist), then patches in row-major order — a direct convolution.
        let mut tokens: Vec<Vec<f64>> = vec![w.get("cls_token")];
        if cfg.distilled {
            tokens.push(w.get("dist_token"));
        }
        for gy in 0..g {
            for gx in 0..g {
                let mut t = vec![0.0; c];
                for (o, t_o) in t.iter_mut().enumerate() {
                    let mut acc = pb[o];
                    for ch in 0..3 {
                        for ky in 0..p {
                            for kx in 0..p {
                                acc += pw[((o * 3 + ch) * p + ky) * p + kx]
                                    * px(b, ch, gy * p + ky, gx * p + kx);
                            }
                        }
                    }
                    *t_o = acc;
                }
                tokens.push(t);
            }
        }
        for (i, t) in tokens.iter_mut().enumerate() {
            for (j, v) in t.iter_mut().enumerate() {
                *v += pos[i * c + j];
            }
        }
        let n = tokens.len();
        for blk in 0..cfg.depth {
            let name = |s: &str| format!("blocks.{blk}.{s}");
            let (g1, b1) = (w.get(&name("norm1.weight")), w.get(&name("norm1.bias")));
            let (qw, qb) = (
                w.get(&name("attn.qkv.weight")),
                w.get(&name("attn.qkv.bias")),
            );
            let (ow, ob) = (
                w.get(&name("attn.proj.weight")),
                w.get(&name("attn.proj.bias")),
            );
            let qkv: Vec<Vec<f64>> = tokens
                .iter()
                .map(|t| linear(&layer_norm(t, &g1, &b1, cfg.ln_eps), &qw, &qb))
                .collect();
            let scale = 1.0 / (hd as f64).sqrt();
            for i in 0..n {
                let mut attn_out = vec![0.0; c];
                for h in 0..heads {
                    let q = &qkv[i][h * hd..(h + 1) * hd];
                    let scores: Vec<f64> = (0..n)
                        .map(|j| {
                            let k = &qkv[j][c + h * hd..c + (h + 1) * hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale
                        })
                        .collect();
                    let probs = softmax(&scores);
                    for d in 0..hd {
                        attn_out[h * hd + d] =
                            (0..n).map(|j| probs[j] * qkv[j][2 * c + h * hd + d]).sum();
                    }
                }
                let proj = linear(&attn_out, &ow, &ob);
                // Residual after all tokens' attention is computed: qkv was taken from the old tokens.
                for (v, p) in tokens[i].iter_mut().zip(proj) {
                    *v += p;
                }
            }
            let (g2, b2) = (w.get(&name("norm2.weight")), w.get(&name("norm2.bias")));
            let (f1w, f1b) = (w.get(&name("mlp.fc1.weight")), w.get(&name("mlp.fc1.bias")));
            let (f2w, f2b) = (w.get(&name("mlp.fc2.weight")), w.get(&name("mlp.fc2.bias")));
            for t in tokens.iter_mut() {
                let hidden: Vec<f64> = linear(&layer_norm(t, &g2, &b2, cfg.ln_eps), &f1w, &f1b)
                    .into_iter()
                    .map(gelu)
                    .collect();
                let m = linear(&hidden, &f2w, &f2b);
                for (v, m) in t.iter_mut().zip(m) {
                    *v += m;
                }
            }
        }
        let (gn, bn) = (w.get("norm.weight"), w.get("norm.bias"));
        let cls = layer_norm(&tokens[0], &gn, &bn, cfg.ln_eps);
        let mut logits = linear(&cls, &w.get("head.weight"), &w.get("head.bias"));
        if cfg.distilled {
            let dist = layer_norm(&tokens[1], &gn, &bn, cfg.ln_eps);
            let ld = linear(&dist, &w.get("head_dist.weight"), &w.get("head_dist.bias"));
            logits = logits.iter().zip(ld).map(|(a, b)| (a + b) / 2.0).collect();
        }
        out.push(logits);
    }
    out
}
