//! Image decoding and the eval transform, as the checkpoint specifies it.
//!
//! Default (timm's DeiT `pretrained_cfg`): bicubic resize of the shorter side to
//! `floor(224 / 0.9) = 248` keeping the aspect ratio, centre crop 224, scale to [0, 1],
//! normalise with the ImageNet mean/std, CHW. A timm `config.json` (`pretrained_cfg`) or a
//! transformers `preprocessor_config.json` next to the weights overrides it.
//!
//! Decoding sniffs the format from the bytes (not the extension) and refuses images over a pixel
//! budget before allocating them; every failure is a [`PreprocessError`] naming the file.

use std::io::Cursor;
use std::path::Path;

use candle_core::{Device, Tensor};
use image::imageops::FilterType;
use image::{ImageFormat, ImageReader, Limits, RgbImage};
use serde_json::Value;

use crate::error::PreprocessError;

/// ImageNet channel means (RGB), timm's `IMAGENET_DEFAULT_MEAN`.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet channel standard deviations (RGB), timm's `IMAGENET_DEFAULT_STD`.
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];
/// Images with more pixels than this are refused before decoding (decompression-bomb guard).
pub const DEFAULT_MAX_PIXELS: u64 = 100_000_000;
/// timm's `DEFAULT_CROP_PCT`, used when a timm config has no `crop_pct`.
pub const TIMM_DEFAULT_CROP_PCT: f64 = 0.875;
/// DeiT's `crop_pct` in timm's `pretrained_cfg`.
pub const DEIT_CROP_PCT: f64 = 0.9;

/// Resampling filter. `Bicubic` is Catmull-Rom (a = -0.5), PIL's bicubic kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interpolation {
    Nearest,
    Bilinear,
    Bicubic,
    Lanczos,
}

impl Interpolation {
    fn filter(self) -> FilterType {
        match self {
            Self::Nearest => FilterType::Nearest,
            Self::Bilinear => FilterType::Triangle,
            Self::Bicubic => FilterType::CatmullRom,
            Self::Lanczos => FilterType::Lanczos3,
        }
    }

    /// timm's names (`bicubic`, `bilinear`, `nearest`, `lanczos`).
    pub fn from_timm(name: &str) -> Option<Self> {
        match name {
            "bicubic" => Some(Self::Bicubic),
            "bilinear" => Some(Self::Bilinear),
            "nearest" => Some(Self::Nearest),
            "lanczos" => Some(Self::Lanczos),
            _ => None,
        }
    }

    /// PIL resample codes used by transformers (0 nearest, 1 lanczos, 2 bilinear, 3 bicubic).
    pub fn from_pil(code: u64) -> Option<Self> {
        match code {
            0 => Some(Self::Nearest),
            1 => Some(Self::Lanczos),
            2 => Some(Self::Bilinear),
            3 => Some(Self::Bicubic),
            _ => None,
        }
    }
}

/// The resize step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resize {
    /// Shorter side to this many pixels, longer side `floor(size · long / short)` (torchvision).
    ShortestEdge(u32),
    /// Exactly this size, ignoring the aspect ratio (transformers' `{"height", "width"}` sizes).
    Exact { width: u32, height: u32 },
    /// No resize.
    None,
}

/// How the centre crop's top-left offset rounds when the margin is odd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CropRounding {
    /// torchvision `CenterCrop` (timm): `int(round(margin / 2))`, Python's round-half-to-even.
    HalfEven,
    /// transformers `center_crop`: `margin // 2`.
    Floor,
}

/// The full eval transform.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessConfig {
    pub resize: Resize,
    pub interpolation: Interpolation,
    /// Centre crop to `(width, height)`; `None` keeps the resized image.
    pub crop: Option<(u32, u32)>,
    pub crop_rounding: CropRounding,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    /// Decoding refuses images with more pixels than this.
    pub max_pixels: u64,
}

impl Default for PreprocessConfig {
    /// timm's DeiT eval transform at 224 (crop_pct 0.9, bicubic, ImageNet mean/std).
    fn default() -> Self {
        Self::timm_eval(224, DEIT_CROP_PCT, Interpolation::Bicubic)
    }
}

impl PreprocessConfig {
    /// timm's `transforms_imagenet_eval` (crop mode `center`): resize the shorter side to
    /// `floor(size / crop_pct)`, centre-crop `size`.
    pub fn timm_eval(size: u32, crop_pct: f64, interpolation: Interpolation) -> Self {
        Self {
            resize: Resize::ShortestEdge((size as f64 / crop_pct).floor() as u32),
            interpolation,
            crop: Some((size, size)),
            crop_rounding: CropRounding::HalfEven,
            mean: IMAGENET_MEAN,
            std: IMAGENET_STD,
            max_pixels: DEFAULT_MAX_PIXELS,
        }
    }

    /// Output `(width, height)` of the transform, when known without an image.
    pub fn output_size(&self) -> Option<(u32, u32)> {
        match (self.crop, self.resize) {
            (Some(c), _) => Some(c),
            (None, Resize::Exact { width, height }) => Some((width, height)),
            _ => None,
        }
    }

    /// From a timm `config.json` (its `pretrained_cfg`: `input_size`, `crop_pct`,
    /// `interpolation`, `mean`, `std`, `crop_mode`). Missing keys take timm's defaults.
    pub fn from_timm_config(json: &Value) -> Result<Self, String> {
        let cfg = json.get("pretrained_cfg").unwrap_or(json);
        let size = match cfg.get("input_size") {
            None => 224,
            Some(v) => {
                let dims = as_u32_vec(v).ok_or("`input_size` is not a list of integers")?;
                match dims.as_slice() {
                    [3, h, w] if h == w => *h,
                    _ => return Err(format!("unsupported `input_size` {v} (need [3, S, S])")),
                }
            }
        };
        let crop_pct = match cfg.get("crop_pct") {
            None | Some(Value::Null) => TIMM_DEFAULT_CROP_PCT,
            Some(v) => v
                .as_f64()
                .filter(|p| *p > 0.0 && *p <= 1.0)
                .ok_or_else(|| format!("invalid `crop_pct` {v}"))?,
        };
        let interpolation = match cfg.get("interpolation").and_then(Value::as_str) {
            None => Interpolation::Bicubic,
            Some(s) => Interpolation::from_timm(s)
                .ok_or_else(|| format!("unsupported interpolation `{s}`"))?,
        };
        let mut out = Self::timm_eval(size, crop_pct, interpolation);
        match cfg.get("crop_mode").and_then(Value::as_str) {
            None | Some("center") => {}
            Some("squash") => {
                let s = (size as f64 / crop_pct).floor() as u32;
                out.resize = Resize::Exact {
                    width: s,
                    height: s,
                };
            }
            Some(other) => return Err(format!("unsupported crop_mode `{other}`")),
        }
        if let Some(m) = cfg.get("mean") {
            out.mean = as_f32_3(m).ok_or_else(|| format!("invalid `mean` {m}"))?;
        }
        if let Some(s) = cfg.get("std") {
            out.std = as_f32_3(s).ok_or_else(|| format!("invalid `std` {s}"))?;
        }
        Ok(out)
    }

    /// From a transformers `preprocessor_config.json` (`do_resize`, `size`, `resample`,
    /// `do_center_crop`, `crop_size`, `do_normalize`, `image_mean`, `image_std`), with
    /// transformers' semantics: an integer `size` means a square `size`×`size` resize (as
    /// `DeiTImageProcessor` / `ViTImageProcessor` do), `{"shortest_edge": s}` keeps the ratio.
    pub fn from_hf_preprocessor(json: &Value) -> Result<Self, String> {
        let flag = |k: &str| json.get(k).and_then(Value::as_bool).unwrap_or(true);
        let resize = if flag("do_resize") {
            match json.get("size") {
                None => Resize::Exact {
                    width: 256,
                    height: 256,
                },
                Some(v) => parse_hf_size(v).ok_or_else(|| format!("unsupported `size` {v}"))?,
            }
        } else {
            Resize::None
        };
        let interpolation = match json.get("resample") {
            None => Interpolation::Bicubic,
            Some(v) => v
                .as_u64()
                .and_then(Interpolation::from_pil)
                .ok_or_else(|| format!("unsupported `resample` {v}"))?,
        };
        let crop = if flag("do_center_crop") {
            match json.get("crop_size") {
                None => Some((224, 224)),
                Some(v) => match parse_hf_size(v) {
                    Some(Resize::Exact { width, height }) => Some((width, height)),
                    _ => return Err(format!("unsupported `crop_size` {v}")),
                },
            }
        } else {
            None
        };
        let (mut mean, mut std) = (IMAGENET_MEAN, IMAGENET_STD);
        if flag("do_normalize") {
            if let Some(m) = json.get("image_mean") {
                mean = as_f32_3(m).ok_or_else(|| format!("invalid `image_mean` {m}"))?;
            }
            if let Some(s) = json.get("image_std") {
                std = as_f32_3(s).ok_or_else(|| format!("invalid `image_std` {s}"))?;
            }
        } else {
            (mean, std) = ([0.0; 3], [1.0; 3]);
        }
        Ok(Self {
            resize,
            interpolation,
            crop,
            crop_rounding: CropRounding::Floor,
            mean,
            std,
            max_pixels: DEFAULT_MAX_PIXELS,
        })
    }

    /// The transform a checkpoint asks for: `preprocessor_config.json` if given, else the
    /// `pretrained_cfg` of a timm `config.json`, else timm's DeiT default at `image_size`.
    pub fn for_checkpoint(
        config_json: Option<&Path>,
        preprocessor_json: Option<&Path>,
        image_size: u32,
    ) -> Result<Self, PreprocessError> {
        let read = |path: &Path| -> Result<Value, PreprocessError> {
            let err = |reason: String| PreprocessError::Config {
                path: path.to_path_buf(),
                reason,
            };
            let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
            serde_json::from_str(&text).map_err(|e| err(format!("invalid JSON: {e}")))
        };
        let cfg_err = |path: &Path| {
            let path = path.to_path_buf();
            move |reason: String| PreprocessError::Config { path, reason }
        };
        if let Some(p) = preprocessor_json {
            return Self::from_hf_preprocessor(&read(p)?).map_err(cfg_err(p));
        }
        if let Some(p) = config_json {
            let json = read(p)?;
            if json.get("pretrained_cfg").is_some() {
                return Self::from_timm_config(&json).map_err(cfg_err(p));
            }
        }
        Ok(Self::timm_eval(
            image_size,
            DEIT_CROP_PCT,
            Interpolation::Bicubic,
        ))
    }

    /// Reads and decodes an image file (see [`decode_image`]).
    pub fn decode_file(&self, path: &Path) -> Result<RgbImage, PreprocessError> {
        decode_image(&read_image_file(path)?, path, self.max_pixels)
    }

    /// The resized image size `(width, height)` for an input of `(width, height)`.
    pub fn resized_size(&self, width: u32, height: u32) -> (u32, u32) {
        match self.resize {
            Resize::None => (width, height),
            Resize::Exact { width, height } => (width, height),
            Resize::ShortestEdge(s) => {
                // torchvision: new_long = int(size * long / short), computed in floating point.
                let long =
                    |l: u32, short: u32| ((s as u64 * l as u64) as f64 / short as f64) as u32;
                if width <= height {
                    (s, long(height, width))
                } else {
                    (long(width, height), s)
                }
            }
        }
    }

    /// Top-left offset `(x, y)` of the centre crop in an image of `(width, height)`; negative when
    /// the crop is larger than the image (the outside is zero-padded, as torchvision does).
    pub fn crop_offset(&self, width: u32, height: u32) -> (i64, i64) {
        let Some((cw, ch)) = self.crop else {
            return (0, 0);
        };
        let off = |size: u32, crop: u32| -> i64 {
            let (size, crop) = (size as i64, crop as i64);
            if size < crop {
                return -((crop - size) / 2);
            }
            match self.crop_rounding {
                CropRounding::Floor => (size - crop) / 2,
                CropRounding::HalfEven => ((size - crop) as f64 / 2.0).round_ties_even() as i64,
            }
        };
        (off(width, cw), off(height, ch))
    }

    /// Resize, crop and normalise a decoded image into CHW f32 values; returns
    /// `(values, width, height)`.
    pub fn transform(&self, img: &RgbImage) -> (Vec<f32>, u32, u32) {
        let (w, h) = img.dimensions();
        let (rw, rh) = self.resized_size(w, h);
        // Skip the resampler when the size is unchanged, as PIL does: keeps pixels bit-exact.
        let resized;
        let src = if (rw, rh) == (w, h) {
            img
        } else {
            resized = image::imageops::resize(img, rw, rh, self.interpolation.filter());
            &resized
        };
        let (ow, oh) = self.crop.unwrap_or((rw, rh));
        let (ox, oy) = self.crop_offset(rw, rh);
        let plane = (ow * oh) as usize;
        let mut out = vec![0f32; 3 * plane];
        for y in 0..oh {
            for x in 0..ow {
                let (sx, sy) = (x as i64 + ox, y as i64 + oy);
                let inside = sx >= 0 && sy >= 0 && sx < rw as i64 && sy < rh as i64;
                let px = if inside {
                    src.get_pixel(sx as u32, sy as u32).0
                } else {
                    [0, 0, 0]
                };
                let i = (y * ow + x) as usize;
                for c in 0..3 {
                    let v = px[c] as f32 / 255.0;
                    out[c * plane + i] = (v - self.mean[c]) / self.std[c];
                }
            }
        }
        (out, ow, oh)
    }

    /// Decodes and transforms one image file into a `[3, H, W]` f32 tensor on the CPU.
    pub fn load(&self, path: &Path) -> Result<Tensor, PreprocessError> {
        let img = self.decode_file(path)?;
        let (values, w, h) = self.transform(&img);
        Ok(Tensor::from_vec(
            values,
            (3, h as usize, w as usize),
            &Device::Cpu,
        )?)
    }

    /// Loads several images into one `[B, 3, H, W]` batch on the CPU.
    pub fn load_batch<P: AsRef<Path>>(&self, paths: &[P]) -> Result<Tensor, PreprocessError> {
        let images = paths
            .iter()
            .map(|p| self.load(p.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Tensor::stack(&images, 0)?)
    }
}

/// Checks an image file's header without decoding its pixels: what [`decode_image`] refuses
/// before it allocates (empty file, unknown format, unreadable header, zero size, over
/// `max_pixels`, a JPEG without its end-of-image marker). A tool can check every input this way
/// before it loads a model, so that a bad file fails in milliseconds, not after a download.
pub fn check_image_file(path: &Path, max_pixels: u64) -> Result<(), PreprocessError> {
    checked_reader(&read_image_file(path)?, path, max_pixels).map(|_| ())
}

/// An image file's bytes, a read error naming the file.
fn read_image_file(path: &Path) -> Result<Vec<u8>, PreprocessError> {
    std::fs::read(path).map_err(|source| PreprocessError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Decodes image bytes, guessing the format from the content. `path` is only used in errors.
///
/// Refuses empty input, unknown formats, zero-sized images and images over `max_pixels` (checked
/// from the header before any pixel buffer is allocated, and again through the decoder's
/// allocation limit).
pub fn decode_image(
    bytes: &[u8],
    path: &Path,
    max_pixels: u64,
) -> Result<RgbImage, PreprocessError> {
    let mut r = checked_reader(bytes, path, max_pixels)?;
    let mut limits = Limits::default();
    // Up to 8 bytes per pixel (RGBA16) for the largest accepted image, plus slack.
    limits.max_alloc = Some(max_pixels.saturating_mul(8).max(64 << 20));
    r.limits(limits);
    let img = r.decode().map_err(decode_error(path))?;
    Ok(img.to_rgb8())
}

/// The decoder's error about `path`'s image, as ours.
fn decode_error(path: &Path) -> impl Fn(image::ImageError) -> PreprocessError + '_ {
    move |e| PreprocessError::Decode {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// A reader over `bytes` with its format guessed from the content, after [`check_image_file`]'s
/// checks of the header.
fn checked_reader<'a>(
    bytes: &'a [u8],
    path: &Path,
    max_pixels: u64,
) -> Result<ImageReader<Cursor<&'a [u8]>>, PreprocessError> {
    let path_buf = || path.to_path_buf();
    if bytes.is_empty() {
        return Err(PreprocessError::Empty { path: path_buf() });
    }
    let reader = || -> Result<ImageReader<Cursor<&[u8]>>, PreprocessError> {
        let r = ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|source| PreprocessError::Io {
                path: path_buf(),
                source,
            })?;
        if r.format().is_none() {
            return Err(PreprocessError::UnknownFormat { path: path_buf() });
        }
        Ok(r)
    };
    let (width, height) = reader()?.into_dimensions().map_err(decode_error(path))?;
    if width == 0 || height == 0 {
        return Err(PreprocessError::ZeroSized { path: path_buf() });
    }
    if width as u64 * height as u64 > max_pixels {
        return Err(PreprocessError::TooLarge {
            path: path_buf(),
            width,
            height,
            max_pixels,
        });
    }
    let r = reader()?;
    // The JPEG decoder fills a truncated scan with grey and reports success; PIL (what the
    // reference pipelines use) refuses such files, and so do we.
    if r.format() == Some(ImageFormat::Jpeg) && !jpeg_is_complete(bytes) {
        return Err(PreprocessError::Decode {
            path: path_buf(),
            reason: "truncated JPEG (no end-of-image marker after the image data)".into(),
        });
    }
    Ok(r)
}

/// Whether a JPEG stream reaches its end-of-image marker: walks the marker segments, skips the
/// entropy-coded data of every scan (byte stuffing `FF 00`, restart markers `FF D0..D7`, fill
/// bytes) and stops at `FF D9`. Data after EOI (e.g. motion-photo trailers) is ignored.
fn jpeg_is_complete(b: &[u8]) -> bool {
    if b.len() < 4 || b[0] != 0xFF || b[1] != 0xD8 {
        return false;
    }
    let mut i = 2;
    let mut in_scan = false;
    while i + 1 < b.len() {
        if b[i] != 0xFF {
            if !in_scan {
                return false; // garbage between segments
            }
            i += 1;
            continue;
        }
        let m = b[i + 1];
        match m {
            0x00 | 0xD0..=0xD7 if in_scan => i += 2,
            0xFF => i += 1,
            0xD9 => return true,
            0x01 | 0xD0..=0xD7 => i += 2, // stand-alone markers
            _ => {
                // A segment with a 2-byte big-endian length (including itself).
                if i + 3 >= b.len() {
                    return false;
                }
                let len = u16::from_be_bytes([b[i + 2], b[i + 3]]) as usize;
                if len < 2 {
                    return false;
                }
                i += 2 + len;
                in_scan = m == 0xDA;
            }
        }
    }
    false
}

fn as_u32_vec(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
        .collect()
}

fn as_f32_3(v: &Value) -> Option<[f32; 3]> {
    let a = v.as_array()?;
    if a.len() != 3 {
        return None;
    }
    let f = |i: usize| a[i].as_f64().map(|x| x as f32);
    Some([f(0)?, f(1)?, f(2)?])
}

/// transformers size dicts: an int (square, as `get_size_dict`'s `default_to_square=True` used by
/// the ViT/DeiT processors), `{"height", "width"}` or `{"shortest_edge"}`.
fn parse_hf_size(v: &Value) -> Option<Resize> {
    let u = |v: &Value| {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .filter(|x| *x > 0)
    };
    if let Some(s) = u(v) {
        return Some(Resize::Exact {
            width: s,
            height: s,
        });
    }
    let (h, w) = (v.get("height").and_then(u), v.get("width").and_then(u));
    if let (Some(height), Some(width)) = (h, w) {
        return Some(Resize::Exact { width, height });
    }
    v.get("shortest_edge").and_then(u).map(Resize::ShortestEdge)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn default_is_timm_deit() {
        let c = PreprocessConfig::default();
        assert_eq!(c.resize, Resize::ShortestEdge(248));
        assert_eq!(c.crop, Some((224, 224)));
        assert_eq!(c.interpolation, Interpolation::Bicubic);
    }

    #[test]
    fn timm_config_parsing() {
        let j = json!({"architecture": "deit_small_patch16_224", "pretrained_cfg": {
            "input_size": [3, 224, 224], "crop_pct": 0.875, "interpolation": "bilinear",
            "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "crop_mode": "center"}});
        let c = PreprocessConfig::from_timm_config(&j).unwrap();
        assert_eq!(c.resize, Resize::ShortestEdge(256));
        assert_eq!(c.interpolation, Interpolation::Bilinear);
        assert_eq!(c.mean, [0.5; 3]);
        assert!(
            PreprocessConfig::from_timm_config(&json!({"pretrained_cfg": {"crop_pct": 2.0}}))
                .is_err()
        );
    }

    #[test]
    fn hf_preprocessor_parsing() {
        // The facebook/deit-* preprocessor_config.json.
        let j = json!({"crop_size": 224, "do_center_crop": true, "do_normalize": true,
            "do_resize": true, "image_mean": [0.485, 0.456, 0.406],
            "image_std": [0.229, 0.224, 0.225], "resample": 3, "size": 256});
        let c = PreprocessConfig::from_hf_preprocessor(&j).unwrap();
        assert_eq!(
            c.resize,
            Resize::Exact {
                width: 256,
                height: 256
            }
        );
        assert_eq!(c.crop, Some((224, 224)));
        assert_eq!(c.crop_rounding, CropRounding::Floor);
        let j = json!({"size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224}});
        let c = PreprocessConfig::from_hf_preprocessor(&j).unwrap();
        assert_eq!(c.resize, Resize::ShortestEdge(256));
        assert!(PreprocessConfig::from_hf_preprocessor(&json!({"resample": 9})).is_err());
    }

    #[test]
    fn jpeg_completeness() {
        let img = RgbImage::from_fn(33, 17, |x, y| image::Rgb([x as u8 * 7, y as u8 * 13, 99]));
        let mut buf = Vec::new();
        img.write_to(&mut Cursor::new(&mut buf), ImageFormat::Jpeg)
            .unwrap();
        assert!(jpeg_is_complete(&buf));
        let mut trailer = buf.clone();
        trailer.extend_from_slice(b"motion photo trailer \xff\xda junk");
        assert!(jpeg_is_complete(&trailer));
        for cut in [buf.len() - 1, buf.len() / 2, 10, 3] {
            assert!(!jpeg_is_complete(&buf[..cut]), "cut at {cut}");
        }
        assert!(decode_image(&trailer, Path::new("t.jpg"), DEFAULT_MAX_PIXELS).is_ok());
    }

    #[test]
    fn resize_and_crop_geometry() {
        let c = PreprocessConfig::default();
        assert_eq!(c.resized_size(500, 375), (330, 248)); // int(248 * 500 / 375) = 330
        assert_eq!(c.resized_size(375, 500), (248, 330));
        assert_eq!(c.resized_size(248, 248), (248, 248));
        // margin 330-224 = 106 -> 53; 248-224 = 24 -> 12
        assert_eq!(c.crop_offset(330, 248), (53, 12));
        // odd margin 25 -> 12.5 rounds half to even -> 12 (Python round), floor -> 12 too;
        // margin 27 -> 13.5 -> 14 (half-even) vs 13 (floor)
        assert_eq!(c.crop_offset(249, 251), (12, 14));
        let mut f = c.clone();
        f.crop_rounding = CropRounding::Floor;
        assert_eq!(f.crop_offset(249, 251), (12, 13));
        // Crop larger than the image: centred padding.
        assert_eq!(c.crop_offset(220, 224), (-2, 0));
    }
}
