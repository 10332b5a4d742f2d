//! Fetching DeiT checkpoints from the Hugging Face Hub (through hf-hub's on-disk cache, so a
//! second run needs no network).

use std::io::IsTerminal;
use std::path::PathBuf;

use hf_hub::api::sync::{Api, ApiBuilder};

use crate::checkpoint::CheckpointFiles;
use crate::config::DeiTConfig;
use crate::error::ModelError;

/// Which family of Hub repositories to take the weights from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HubSource {
    /// `timm/deit_{size}[_distilled]_patch16_224.fb_in1k` (`model.safetensors`, timm names).
    #[default]
    Timm,
    /// `facebook/deit-{size}[-distilled]-patch16-224` (transformers names; `model.safetensors`
    /// or, on repos that only have it, `pytorch_model.bin`).
    Facebook,
}

impl HubSource {
    /// The repository holding `cfg`'s weights, or `None` for a config that is not published.
    pub fn repo(self, cfg: &DeiTConfig) -> Option<String> {
        match self {
            Self::Timm => cfg.timm_repo(),
            Self::Facebook => cfg.facebook_repo(),
        }
    }
}

fn api(repo: &str, file: &str) -> Result<Api, ModelError> {
    ApiBuilder::from_env()
        // Progress bars only for a person watching; they would garble logs and piped output.
        .with_progress(std::io::stderr().is_terminal())
        .build()
        .map_err(|e| ModelError::Download {
            repo: repo.into(),
            file: file.into(),
            reason: e.to_string(),
        })
}

/// Downloads (or finds in the cache) the weights, `config.json` and, for the facebook repos,
/// `preprocessor_config.json` of the published model `cfg`.
///
/// Failing to get the weights is an error naming the repo and file; the JSON files are optional
/// (their absence means timm's DeiT defaults are used).
pub fn fetch(cfg: &DeiTConfig, source: HubSource) -> Result<CheckpointFiles, ModelError> {
    let repo_id = source.repo(cfg).ok_or_else(|| ModelError::InvalidConfig {
        name: cfg.name.clone(),
        reason:
            "not a published DeiT config, so there is no Hub checkpoint for it; pass --weights FILE"
                .into(),
    })?;
    let api = api(&repo_id, "model.safetensors")?;
    let repo = api.model(repo_id.clone());
    let weights: PathBuf = match repo.get("model.safetensors") {
        Ok(p) => p,
        Err(first) => {
            let first = first.to_string();
            // Some facebook repos' main branch only has the PyTorch pickle; try it only when the
            // safetensors file is absent (404), not when the Hub is unreachable.
            let not_found = first.contains("404");
            match (source, not_found) {
                (HubSource::Facebook, true) => {
                    repo.get("pytorch_model.bin")
                        .map_err(|e| ModelError::Download {
                            repo: repo_id.clone(),
                            file: "pytorch_model.bin".into(),
                            reason: one_line(&e.to_string()),
                        })?
                }
                _ => {
                    return Err(ModelError::Download {
                        repo: repo_id,
                        file: "model.safetensors".into(),
                        reason: one_line(&first),
                    })
                }
            }
        }
    };
    let config = repo.get("config.json").ok();
    let preprocessor_config = match source {
        HubSource::Facebook => repo.get("preprocessor_config.json").ok(),
        HubSource::Timm => None,
    };
    Ok(CheckpointFiles {
        weights,
        config,
        preprocessor_config,
    })
}

/// Error chains from the HTTP stack can contain newlines; the CLI promises one line.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
