//! Preprocessing: known pixels in, expected normalised values out; geometry; bad files.

use std::path::{Path, PathBuf};

use image::{ImageFormat, Rgb, RgbImage};
use models::preprocess::{CropRounding, DEFAULT_MAX_PIXELS, IMAGENET_MEAN, IMAGENET_STD};
use models::{Interpolation, PreprocessConfig, PreprocessError, Resize};

fn write(img: &RgbImage, dir: &Path, name: &str, fmt: ImageFormat) -> PathBuf {
    let p = dir.join(name);
    img.save_with_format(&p, fmt).unwrap();
    p
}

fn normalised(v: u8, c: usize) -> f32 {
    (v as f32 / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
}

/// A deterministic "random" image (no resampling-friendly structure).
fn noise_image(w: u32, h: u32, seed: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let v = (x.wrapping_mul(7919) ^ y.wrapping_mul(104729) ^ seed).wrapping_mul(2654435761);
        Rgb([(v >> 8) as u8, (v >> 16) as u8, (v >> 24) as u8])
    })
}

#[test]
fn uniform_colour_gives_normalised_constant() {
    let dir = tempfile::tempdir().unwrap();
    let colour = [10u8, 128, 250];
    let img = RgbImage::from_pixel(300, 260, Rgb(colour));
    let p = write(&img, dir.path(), "uniform.png", ImageFormat::Png);
    let t = PreprocessConfig::default().load(&p).unwrap();
    assert_eq!(t.dims(), &[3, 224, 224]);
    let v = t.to_vec3::<f32>().unwrap();
    for (c, plane) in v.iter().enumerate() {
        let want = normalised(colour[c], c);
        for row in plane {
            for &x in row {
                assert!((x - want).abs() < 1e-6, "channel {c}: {x} vs {want}");
            }
        }
    }
}

#[test]
fn crop_pct_one_at_224_is_identity() {
    let dir = tempfile::tempdir().unwrap();
    let img = noise_image(224, 224, 1);
    let p = write(&img, dir.path(), "noise.png", ImageFormat::Png);
    let cfg = PreprocessConfig::timm_eval(224, 1.0, Interpolation::Bicubic);
    assert_eq!(cfg.resize, Resize::ShortestEdge(224));
    let v = cfg.load(&p).unwrap().to_vec3::<f32>().unwrap();
    for y in 0..224 {
        for x in 0..224 {
            let px = img.get_pixel(x, y).0;
            for c in 0..3 {
                assert_eq!(
                    v[c][y as usize][x as usize],
                    normalised(px[c], c),
                    "({x},{y},{c})"
                );
            }
        }
    }
}

#[test]
fn resize_target_and_aspect_ratio() {
    let cfg = PreprocessConfig::default();
    assert_eq!(cfg.resize, Resize::ShortestEdge(248)); // floor(224 / 0.9)
    assert_eq!(cfg.resized_size(300, 400), (248, 330)); // int(248 * 400 / 300) = 330
    assert_eq!(cfg.resized_size(640, 480), (330, 248));
    assert_eq!(
        PreprocessConfig::timm_eval(224, 0.875, Interpolation::Bicubic).resize,
        Resize::ShortestEdge(256)
    );
}

#[test]
fn centre_crop_offsets_on_non_square_images() {
    let dir = tempfile::tempdir().unwrap();
    // crop_pct 1.0: the shorter side is already 224, so only the crop moves pixels.
    let cfg = PreprocessConfig::timm_eval(224, 1.0, Interpolation::Bicubic);
    // (width, height, expected x offset, expected y offset): margin 36 -> 18; margin 25 -> 12.5
    // -> 12 (round half to even, like torchvision); margin 27 -> 13.5 -> 14.
    for (w, h, ox, oy) in [
        (260u32, 224u32, 18u32, 0u32),
        (249, 224, 12, 0),
        (224, 251, 0, 14),
    ] {
        let img = noise_image(w, h, w + h);
        let p = write(&img, dir.path(), &format!("{w}x{h}.png"), ImageFormat::Png);
        assert_eq!(cfg.resized_size(w, h), (w, h));
        let v = cfg.load(&p).unwrap().to_vec3::<f32>().unwrap();
        for (x, y) in [(0u32, 0u32), (223, 223), (17, 200), (100, 3)] {
            let px = img.get_pixel(x + ox, y + oy).0;
            for c in 0..3 {
                assert_eq!(
                    v[c][y as usize][x as usize],
                    normalised(px[c], c),
                    "{w}x{h} at ({x},{y})"
                );
            }
        }
    }
    // transformers' rounding floors instead.
    let mut floor = cfg.clone();
    floor.crop_rounding = CropRounding::Floor;
    assert_eq!(floor.crop_offset(224, 251), (0, 13));
}

#[test]
fn format_is_sniffed_from_content_and_batches_stack() {
    let dir = tempfile::tempdir().unwrap();
    let img = noise_image(64, 48, 3);
    // PNG bytes under a .jpg name, JPEG, BMP and lossless WebP.
    let png_as_jpg = dir.path().join("actually_png.jpg");
    img.save_with_format(&png_as_jpg, ImageFormat::Png).unwrap();
    let jpg = write(&img, dir.path(), "a.jpeg", ImageFormat::Jpeg);
    let bmp = write(&img, dir.path(), "a.bmp", ImageFormat::Bmp);
    let webp = write(&img, dir.path(), "a.webp", ImageFormat::WebP);
    let cfg = PreprocessConfig::default();
    let batch = cfg.load_batch(&[&png_as_jpg, &jpg, &bmp, &webp]).unwrap();
    assert_eq!(batch.dims(), &[4, 3, 224, 224]);
    // Lossless formats decode to the same pixels, hence the same tensor.
    let a = batch.get(0).unwrap();
    for i in [2, 3] {
        let d = (&a - batch.get(i).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "image {i}");
    }
    // Grayscale input becomes three equal channels.
    let gray = image::GrayImage::from_fn(40, 30, |x, y| image::Luma([(x * 5 + y) as u8]));
    let gp = dir.path().join("gray.png");
    gray.save(&gp).unwrap();
    let t = cfg.load(&gp).unwrap();
    let v = t.to_vec3::<f32>().unwrap();
    let raw = |c: usize| v[c][100][100] * IMAGENET_STD[c] + IMAGENET_MEAN[c];
    assert!((raw(0) - raw(1)).abs() < 1e-6 && (raw(1) - raw(2)).abs() < 1e-6);
}

#[test]
fn bad_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = PreprocessConfig::default();
    let check = |p: &Path, ok: fn(&PreprocessError) -> bool, words: &[&str]| {
        let err = cfg.load(p).expect_err(&format!("{p:?} decoded"));
        let msg = err.to_string();
        assert!(ok(&err), "{p:?}: {msg}");
        assert!(
            msg.contains(p.file_name().unwrap().to_str().unwrap()),
            "{msg}"
        );
        for w in words {
            assert!(msg.contains(w), "{msg} lacks {w}");
        }
        assert!(!msg.contains('\n'), "{msg}");
    };
    // Missing.
    check(
        &dir.path().join("missing.png"),
        |e| matches!(e, PreprocessError::Io { .. }),
        &[],
    );
    // Empty.
    let empty = dir.path().join("empty.png");
    std::fs::write(&empty, b"").unwrap();
    check(
        &empty,
        |e| matches!(e, PreprocessError::Empty { .. }),
        &["empty"],
    );
    // Not an image.
    let text = dir.path().join("notes.jpg");
    std::fs::write(&text, b"hello, this is text and not a JPEG").unwrap();
    check(
        &text,
        |e| matches!(e, PreprocessError::UnknownFormat { .. }),
        &["unrecognised image format"],
    );
    // Truncated PNG and JPEG.
    let img = noise_image(128, 96, 9);
    for (name, fmt) in [
        ("trunc.png", ImageFormat::Png),
        ("trunc.jpg", ImageFormat::Jpeg),
    ] {
        let full = write(&img, dir.path(), name, fmt);
        let bytes = std::fs::read(&full).unwrap();
        std::fs::write(&full, &bytes[..bytes.len() / 2]).unwrap();
        check(&full, |e| matches!(e, PreprocessError::Decode { .. }), &[]);
    }
    // Huge: a BMP header claiming 20000 x 20000 pixels (400 Mpixels), refused before decoding.
    let small = write(
        &RgbImage::new(2, 2),
        dir.path(),
        "huge.bmp",
        ImageFormat::Bmp,
    );
    let mut bytes = std::fs::read(&small).unwrap();
    bytes[18..22].copy_from_slice(&20000i32.to_le_bytes());
    bytes[22..26].copy_from_slice(&20000i32.to_le_bytes());
    std::fs::write(&small, &bytes).unwrap();
    check(
        &small,
        |e| matches!(e, PreprocessError::TooLarge { .. }),
        &["20000x20000", "400000000"],
    );
    // The limit is configurable: a lower budget refuses a normal image.
    let mut tight = cfg.clone();
    tight.max_pixels = 100;
    let normal = write(&img, dir.path(), "normal.png", ImageFormat::Png);
    assert!(matches!(
        tight.load(&normal),
        Err(PreprocessError::TooLarge { .. })
    ));
    assert_eq!(cfg.max_pixels, DEFAULT_MAX_PIXELS);
}

#[test]
fn checkpoint_configs_drive_preprocessing() {
    let dir = tempfile::tempdir().unwrap();
    let timm = dir.path().join("config.json");
    std::fs::write(
        &timm,
        r#"{"architecture": "deit_small_patch16_224", "num_classes": 1000,
            "pretrained_cfg": {"input_size": [3, 224, 224], "crop_pct": 0.9,
            "interpolation": "bicubic", "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225], "crop_mode": "center"}}"#,
    )
    .unwrap();
    let c = PreprocessConfig::for_checkpoint(Some(&timm), None, 224).unwrap();
    assert_eq!(c, PreprocessConfig::default());
    let hf = dir.path().join("preprocessor_config.json");
    std::fs::write(
        &hf,
        r#"{"crop_size": 224, "do_center_crop": true, "do_normalize": true, "do_resize": true,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": 256}"#,
    )
    .unwrap();
    let c = PreprocessConfig::for_checkpoint(Some(&timm), Some(&hf), 224).unwrap();
    assert_eq!(
        c.resize,
        Resize::Exact {
            width: 256,
            height: 256
        }
    );
    assert_eq!(c.interpolation, Interpolation::Bilinear);
    assert_eq!(c.mean, [0.5; 3]);
    // A uniform image through this config: (v/255 - 0.5) / 0.5.
    let img = RgbImage::from_pixel(300, 200, Rgb([51, 102, 204]));
    let p = write(&img, dir.path(), "u.png", ImageFormat::Png);
    let v = c.load(&p).unwrap().to_vec3::<f32>().unwrap();
    for (ch, want) in [51u8, 102, 204].iter().enumerate() {
        let want = (*want as f32 / 255.0 - 0.5) / 0.5;
        assert!((v[ch][5][7] - want).abs() < 1e-6);
    }
    // Broken config JSON is an error naming the file.
    std::fs::write(&hf, "{").unwrap();
    let err = PreprocessConfig::for_checkpoint(None, Some(&hf), 224)
        .unwrap_err()
        .to_string();
    assert!(err.contains("preprocessor_config.json"), "{err}");
}
