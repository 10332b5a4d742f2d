//! Class names: from a checkpoint's `config.json` (`id2label` in transformers configs,
//! `label_names` in timm configs) when present, else the embedded ImageNet-1k list.

use std::path::Path;
use std::sync::OnceLock;

use crate::error::ModelError;

/// One ImageNet-1k class: its index (the model's output index), WordNet id and name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageNetClass {
    pub index: usize,
    /// WordNet id, the folder name in the ImageNet val/train layout (e.g. `n01440764`).
    pub wnid: &'static str,
    /// Comma-separated lemmas, e.g. `tench, Tinca tinca` (the strings in the Hub's `id2label`).
    pub name: &'static str,
}

const IMAGENET1K_TSV: &str = include_str!("../data/imagenet1k.tsv");

/// The 1000 ImageNet-1k classes in class-index order (sorted WordNet ids).
pub fn imagenet1k_classes() -> &'static [ImageNetClass] {
    static CLASSES: OnceLock<Vec<ImageNetClass>> = OnceLock::new();
    CLASSES.get_or_init(|| {
        IMAGENET1K_TSV
            .lines()
            .enumerate()
            .map(|(i, line)| {
                let mut f = line.splitn(3, '\t');
                let (idx, wnid, name) = (f.next(), f.next(), f.next());
                let idx: usize = idx
                    .and_then(|s| s.parse().ok())
                    .expect("embedded tsv index");
                assert_eq!(idx, i, "embedded imagenet1k.tsv is out of order");
                ImageNetClass {
                    index: idx,
                    wnid: wnid.expect("embedded tsv wnid"),
                    name: name.expect("embedded tsv name"),
                }
            })
            .collect()
    })
}

/// The class index of a WordNet id (`n01440764` → 0).
pub fn imagenet1k_index_of_wnid(wnid: &str) -> Option<usize> {
    let classes = imagenet1k_classes();
    // The list is sorted by wnid, which is what makes index order == sorted order.
    classes
        .binary_search_by(|c| c.wnid.cmp(wnid))
        .ok()
        .map(|i| classes[i].index)
}

/// Class names for a model with `num_classes` outputs.
///
/// Taken from `config_json` when it has `id2label` (transformers) or `label_names` (timm) with
/// exactly `num_classes` entries; otherwise the embedded ImageNet-1k names for 1000 classes, or
/// `class {i}` for other class counts (custom checkpoints without names).
pub fn class_names(
    num_classes: usize,
    config_json: Option<&Path>,
) -> Result<Vec<String>, ModelError> {
    if let Some(path) = config_json {
        let err = |reason: String| ModelError::ReadConfig {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| err(format!("invalid JSON: {e}")))?;
        if let Some(names) = names_from_config(&json, num_classes).map_err(err)? {
            return Ok(names);
        }
    }
    if num_classes == 1000 {
        return Ok(imagenet1k_classes()
            .iter()
            .map(|c| c.name.to_string())
            .collect());
    }
    Ok((0..num_classes).map(|i| format!("class {i}")).collect())
}

/// `Ok(None)` when the config has no usable label list.
fn names_from_config(
    json: &serde_json::Value,
    num_classes: usize,
) -> Result<Option<Vec<String>>, String> {
    if let Some(map) = json.get("id2label").and_then(|v| v.as_object()) {
        if map.len() != num_classes {
            return Ok(None);
        }
        let mut names = vec![None; num_classes];
        for (k, v) in map {
            let i: usize = k
                .parse()
                .map_err(|_| format!("id2label key `{k}` is not an index"))?;
            let slot = names
                .get_mut(i)
                .ok_or_else(|| format!("id2label index {i} is out of range"))?;
            *slot = Some(
                v.as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| v.to_string()),
            );
        }
        return Ok(names.into_iter().collect::<Option<Vec<_>>>());
    }
    if let Some(list) = json.get("label_names").and_then(|v| v.as_array()) {
        if list.len() == num_classes {
            let names: Vec<String> = list
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| v.to_string())
                })
                .collect();
            // timm stores WordNet ids here; translate them to readable names when we can.
            let names = names
                .into_iter()
                .map(|n| match imagenet1k_index_of_wnid(&n) {
                    Some(i) => imagenet1k_classes()[i].name.to_string(),
                    None => n,
                })
                .collect();
            return Ok(Some(names));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_imagenet_list() {
        let c = imagenet1k_classes();
        assert_eq!(c.len(), 1000);
        assert!(
            c.windows(2).all(|w| w[0].wnid < w[1].wnid),
            "wnids must be sorted"
        );
        assert_eq!(c[0].wnid, "n01440764");
        assert!(c[0].name.starts_with("tench"));
        assert!(c[281].name.starts_with("tabby"));
        assert_eq!(imagenet1k_index_of_wnid("n02123045"), Some(281));
        assert_eq!(imagenet1k_index_of_wnid("n99999999"), None);
    }

    #[test]
    fn names_from_id2label_and_fallbacks() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, r#"{"id2label": {"1": "dog", "0": "cat"}}"#).unwrap();
        assert_eq!(class_names(2, Some(&p)).unwrap(), vec!["cat", "dog"]);
        // Wrong count: ignore the config's list.
        assert_eq!(class_names(3, Some(&p)).unwrap()[2], "class 2");
        assert!(class_names(1000, None).unwrap()[1].starts_with("goldfish"));
        std::fs::write(&p, "{not json").unwrap();
        let err = class_names(2, Some(&p)).unwrap_err().to_string();
        assert!(
            err.contains("config.json") && err.contains("invalid JSON"),
            "{err}"
        );
    }
}
