//! `--config FILE`: a TOML file of flag values, as an alternative to flags.
//!
//! Owns: reading the file and turning each key into the flag's environment variable before
//! the command line is parsed, so the precedence is flags > environment > file > defaults.
//! Keys are the long flag names (`session-ttl` or `session_ttl`); an unknown key, or one whose
//! flag cannot come from the environment, is an error that names it.
//!
//! Must not: know individual flags: the list comes from the clap definition.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use clap::CommandFactory;

use crate::cli::Cli;

/// Long flag name → environment variable, over every subcommand.
fn env_names() -> BTreeMap<String, Option<String>> {
    fn walk(cmd: &clap::Command, out: &mut BTreeMap<String, Option<String>>) {
        for arg in cmd.get_arguments() {
            if let Some(long) = arg.get_long() {
                let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
                let slot = out.entry(long.to_owned()).or_insert(None);
                if slot.is_none() {
                    *slot = env;
                }
            }
        }
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    let mut out = BTreeMap::new();
    walk(&Cli::command(), &mut out);
    out
}

/// The `--config` path from the raw arguments or `CHANWATCH_CONFIG`, if any.
pub fn config_path(args: &[OsString]) -> Option<OsString> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--config" {
            return it.next().cloned();
        }
        if let Some(v) = s.strip_prefix("--config=") {
            return Some(v.into());
        }
    }
    std::env::var_os("CHANWATCH_CONFIG")
}

/// Finds `--config` in the raw arguments (or `CHANWATCH_CONFIG`) and sets the environment
/// variables its file holds. Call it before any thread exists: it changes the environment.
///
/// # Errors
/// As [`load`].
pub fn apply(args: impl IntoIterator<Item = OsString>) -> Result<()> {
    let args: Vec<OsString> = args.into_iter().collect();
    if let Some(path) = config_path(&args) {
        // Single-threaded here: no runtime or thread exists yet.
        load(Path::new(&path))?
            .into_iter()
            .for_each(|(k, v)| std::env::set_var(k, v));
    }
    Ok(())
}

/// Reads `path` and returns the environment variables it sets (those not already set).
///
/// # Errors
/// Unreadable file, bad TOML, an unknown key, a key that cannot be configured, a bad value.
pub fn load(path: &Path) -> Result<Vec<(String, String)>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --config {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| anyhow!("--config {}: not valid TOML: {e}", path.display()))?;
    let names = env_names();
    let mut out = Vec::new();
    for (key, value) in table {
        let flag = key.replace('_', "-");
        let env = match names.get(&flag) {
            None => bail!(
                "--config {}: unknown key `{key}`; keys are long flag names such as session-ttl, endpoints, admin",
                path.display()
            ),
            Some(None) => bail!(
                "--config {}: key `{key}` cannot be set from a config file; pass --{flag} on the command line",
                path.display()
            ),
            Some(Some(env)) => env.clone(),
        };
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    toml::Value::String(s) => Ok(s.clone()),
                    other => Err(anyhow!(
                        "--config {}: `{key}` must hold strings, found {other}",
                        path.display()
                    )),
                })
                .collect::<Result<Vec<_>>>()?
                .join(","),
            other => bail!(
                "--config {}: `{key}` has an unsupported value {other}",
                path.display()
            ),
        };
        if std::env::var_os(&env).is_none() {
            out.push((env, text));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        use std::io::Write;
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        f.write_all(text.as_bytes()).expect("write");
        f
    }

    #[test]
    fn keys_become_the_flags_environment_variables() {
        let f = write("session_ttl = \"3s\"\nendpoints = [\"http://a:2379\", \"http://b:2379\"]\nmax-txn-ops = 64\n");
        let mut got = load(f.path()).expect("valid file");
        got.sort();
        assert!(
            got.contains(&("CHANWATCH_SESSION_TTL".into(), "3s".into())),
            "{got:?}"
        );
        assert!(
            got.contains(&(
                "CHANWATCH_ENDPOINTS".into(),
                "http://a:2379,http://b:2379".into()
            )),
            "{got:?}"
        );
        assert!(
            got.contains(&("CHANWATCH_MAX_TXN_OPS".into(), "64".into())),
            "{got:?}"
        );
    }

    #[test]
    fn an_unknown_key_is_an_error_that_names_it() {
        let f = write("sesion-ttl = \"3s\"\n");
        let err = load(f.path()).expect_err("typo").to_string();
        assert!(err.contains("unknown key `sesion-ttl`"), "{err}");
        let f = write("json = true\n");
        let err = load(f.path()).expect_err("not configurable").to_string();
        assert!(err.contains("cannot be set from a config file"), "{err}");
        let f = write("this is not toml");
        assert!(load(f.path()).is_err());
    }

    #[test]
    fn the_config_flag_is_found_in_either_form() {
        let args: Vec<OsString> = ["chanwatch", "coord", "--config", "x.toml"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(config_path(&args), Some(OsString::from("x.toml")));
        let args: Vec<OsString> = ["chanwatch", "--config=y.toml", "node"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(config_path(&args), Some(OsString::from("y.toml")));
    }
}
