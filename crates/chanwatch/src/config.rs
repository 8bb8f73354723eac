//! `--config FILE`: a TOML file of flag values, as an alternative to flags.
//!
//! Owns: reading the file and turning each key into the flag's environment variable before
//! the command line is parsed, so the precedence is flags > environment > file > defaults.
//! Keys are the long flag names (`session-ttl` or `session_ttl`); an unknown key, or one whose
//! flag cannot come from the environment, is an error that names it. A key means the flag of
//! the subcommand being run (`admin` is `CHANWATCH_NODE_ADMIN` for `node`, `CHANWATCH_ADMIN`
//! for `coord`); one file can serve several subcommands, so a key only another subcommand
//! has is accepted and sets that one's variable.
//!
//! Must not: know individual flags: the list comes from the clap definition.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use clap::CommandFactory;

use crate::cli::Cli;

/// Long flag name → environment variable: first the flags of the subcommand `path` names
/// (and of the commands above it), then those of every other subcommand.
fn env_names(path: &[String]) -> BTreeMap<String, Option<String>> {
    fn add(cmd: &clap::Command, out: &mut BTreeMap<String, Option<String>>) {
        for arg in cmd.get_arguments() {
            if let Some(long) = arg.get_long() {
                let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
                let slot = out.entry(long.to_owned()).or_insert(None);
                if slot.is_none() {
                    *slot = env;
                }
            }
        }
    }
    fn walk(cmd: &clap::Command, out: &mut BTreeMap<String, Option<String>>) {
        add(cmd, out);
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    let root = Cli::command();
    let mut out = BTreeMap::new();
    let mut chain = vec![&root];
    for name in path {
        match chain.last().and_then(|c| c.find_subcommand(name)) {
            Some(sub) => chain.push(sub),
            None => break,
        }
    }
    for cmd in chain.iter().rev() {
        add(cmd, &mut out);
    }
    walk(&root, &mut out);
    out
}

/// The subcommand path the raw arguments name (`["node"]`, `["ctl", "channels"]`): each word
/// that names a subcommand of the one before it.
pub fn subcommand_path(args: &[OsString]) -> Vec<String> {
    let root = Cli::command();
    let mut cmd = &root;
    let mut path = Vec::new();
    for a in args.iter().skip(1) {
        let a = a.to_string_lossy();
        if a.starts_with('-') {
            continue;
        }
        if let Some(sub) = cmd.find_subcommand(a.as_ref()) {
            path.push(sub.get_name().to_owned());
            cmd = sub;
        }
    }
    path
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
        load(Path::new(&path), &subcommand_path(&args))?
            .into_iter()
            .for_each(|(k, v)| std::env::set_var(k, v));
    }
    Ok(())
}

/// Reads `path` and returns the environment variables it sets (those not already set), for
/// the subcommand `subcommand` names (see [`subcommand_path`]).
///
/// # Errors
/// Unreadable file, bad TOML, an unknown key, a key that cannot be configured, a bad value.
pub fn load(path: &Path, subcommand: &[String]) -> Result<Vec<(String, String)>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --config {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| anyhow!("--config {}: not valid TOML: {e}", path.display()))?;
    let names = env_names(subcommand);
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
        let mut got = load(f.path(), &[]).expect("valid file");
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
        let err = load(f.path(), &[]).expect_err("typo").to_string();
        assert!(err.contains("unknown key `sesion-ttl`"), "{err}");
        // Only the test-only --plant has no variable (see the flag walk below).
        let f = write("plant = \"no-watch-progress\"\n");
        let err = load(f.path(), &[])
            .expect_err("not configurable")
            .to_string();
        assert!(err.contains("cannot be set from a config file"), "{err}");
        let f = write("this is not toml");
        assert!(load(f.path(), &[]).is_err());
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

    #[test]
    fn a_key_means_the_flag_of_the_subcommand_being_run() {
        let f = write("admin = \"127.0.0.1:0\"\n");
        let path =
            |args: &[&str]| subcommand_path(&args.iter().map(OsString::from).collect::<Vec<_>>());
        assert_eq!(path(&["chanwatch", "--config", "c.toml", "node"]), ["node"]);
        assert_eq!(
            path(&["chanwatch", "ctl", "-o", "json", "nodes"]),
            ["ctl", "nodes"]
        );
        let node = load(f.path(), &path(&["chanwatch", "node"])).expect("valid");
        assert_eq!(
            node,
            [("CHANWATCH_NODE_ADMIN".into(), "127.0.0.1:0".into())]
        );
        let coord = load(f.path(), &path(&["chanwatch", "coord"])).expect("valid");
        assert_eq!(coord, [("CHANWATCH_ADMIN".into(), "127.0.0.1:0".into())]);
    }

    #[test]
    fn the_deploy_config_files_load_for_their_subcommands() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
        let mut files = Vec::new();
        for sub in ["coord", "node", "ctl"] {
            let path = root.join(format!("config/{sub}.toml"));
            let text = std::fs::read_to_string(&path).expect("readable");
            files.push((sub, path.display().to_string(), text));
        }
        let map = std::fs::read_to_string(root.join("kubernetes/configmap.yaml")).expect("map");
        let map: serde_json::Value = serde_yaml_ng::from_str(&map).expect("YAML");
        for sub in ["coord", "node"] {
            let text = map["data"][format!("{sub}.toml")]
                .as_str()
                .expect("toml")
                .to_owned();
            files.push((sub, format!("configmap {sub}.toml"), text));
        }
        for (sub, name, text) in files {
            let f = write(&text);
            let vars =
                load(f.path(), &[sub.to_owned()]).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert!(vars.len() >= 5, "{name}: {vars:?}");
            if sub == "node" {
                assert!(
                    vars.iter().any(|(k, _)| k == "CHANWATCH_NODE_ADMIN"),
                    "{name}: {vars:?}"
                );
            }
        }
    }

    /// Runs [`flag_walk_child`] in a process of its own: it sets environment variables, which
    /// would race with the other tests of this binary.
    #[test]
    fn every_flag_of_every_subcommand_has_a_variable_and_a_config_key_that_sets_it() {
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "config::tests::flag_walk_child",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("CHANWATCH_FLAG_WALK_CHILD", "1")
            .output()
            .expect("runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && text.contains("flags checked"),
            "{text}"
        );
    }

    /// A value `cmd` accepts for `arg` on the command line, with the parsed raw values.
    fn a_value(cmd: &clap::Command, arg: &clap::Arg) -> Option<(toml::Value, Vec<OsString>)> {
        let long = arg.get_long()?;
        let candidates: Vec<String> = if !arg.get_action().takes_values() {
            vec!["true".into()]
        } else if !arg.get_possible_values().is_empty() {
            arg.get_possible_values()
                .iter()
                .map(|p| p.get_name().to_owned())
                .collect()
        } else {
            ["3s", "7", "http://127.0.0.1:1", "x", "a=1"]
                .map(String::from)
                .to_vec()
        };
        for v in candidates {
            let cli = if arg.get_action().takes_values() {
                vec![format!("--{long}={v}")]
            } else {
                vec![format!("--{long}")]
            };
            let m = cmd
                .clone()
                .try_get_matches_from(std::iter::once("t".to_owned()).chain(cli));
            if let Ok(m) = m {
                let raw: Vec<OsString> = m
                    .get_raw(arg.get_id().as_str())
                    .map(|r| r.map(ToOwned::to_owned).collect())
                    .unwrap_or_default();
                let value = if arg.get_action().takes_values() {
                    toml::Value::String(v)
                } else {
                    toml::Value::Boolean(true)
                };
                return Some((value, raw));
            }
        }
        None
    }

    /// The command at `path` from a fresh definition.
    fn command_at(path: &[String]) -> clap::Command {
        let mut cmd = Cli::command();
        for name in path {
            cmd = cmd
                .find_subcommand(name)
                .expect("a subcommand on the path")
                .clone();
        }
        cmd
    }

    /// `cmd` parsing only its own flags: no required positional, flag or subcommand.
    fn only_own_flags(cmd: clap::Command) -> clap::Command {
        cmd.subcommand_required(false)
            .arg_required_else_help(false)
            .mut_args(|a| a.required(false))
    }

    #[test]
    fn flag_walk_child() {
        if std::env::var_os("CHANWATCH_FLAG_WALK_CHILD").is_none() {
            return; // run by the test above, in a process of its own
        }
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("CHANWATCH_") {
                std::env::remove_var(k);
            }
        }
        fn commands(
            cmd: &clap::Command,
            path: Vec<String>,
            out: &mut Vec<(Vec<String>, clap::Command)>,
        ) {
            out.push((path.clone(), cmd.clone()));
            for sub in cmd.get_subcommands() {
                let mut p = path.clone();
                p.push(sub.get_name().to_owned());
                commands(sub, p, out);
            }
        }
        let mut all = Vec::new();
        commands(&Cli::command(), Vec::new(), &mut all);
        let mut problems = Vec::new();
        let mut checked = 0;
        let dir = tempfile::tempdir().expect("tempdir");
        for (path, cmd) in all {
            let here = if path.is_empty() {
                "chanwatch".to_owned()
            } else {
                path.join(" ")
            };
            let cmd = only_own_flags(cmd);
            for arg in cmd.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                // `--plant` (hidden, tests only) switches a safety mechanism off: it comes from
                // the command line alone, never from a stray variable or config file.
                if ["help", "version", "config", "plant"].contains(&long) {
                    continue;
                }
                let Some(env) = arg.get_env().map(|e| e.to_string_lossy().into_owned()) else {
                    problems.push(format!("{here} --{long}: no environment variable"));
                    continue;
                };
                if !env.starts_with("CHANWATCH_") {
                    problems.push(format!(
                        "{here} --{long}: variable {env} is not CHANWATCH_*"
                    ));
                }
                let Some((value, cli_raw)) = a_value(&cmd, arg) else {
                    // Flags that need another (--etcd-user with --etcd-password): the key
                    // must still name this flag's variable.
                    let file = dir.path().join("c.toml");
                    std::fs::write(&file, format!("{long} = \"x\"\n")).expect("write");
                    match load(&file, &path) {
                        Ok(vars) if vars.iter().any(|(k, _)| k == &env) => checked += 1,
                        other => {
                            problems.push(format!("{here} --{long}: key sets {other:?}, not {env}"))
                        }
                    }
                    continue;
                };
                let file = dir.path().join("c.toml");
                let mut table = toml::Table::new();
                table.insert(long.to_owned(), value);
                std::fs::write(&file, toml::to_string(&table).expect("toml")).expect("write");
                let vars = match load(&file, &path) {
                    Ok(v) => v,
                    Err(e) => {
                        problems.push(format!("{here} --{long}: config key refused: {e:#}"));
                        continue;
                    }
                };
                if vars.len() != 1 || vars[0].0 != env {
                    problems.push(format!(
                        "{here} --{long}: the key sets {vars:?}, the flag reads {env}"
                    ));
                    continue;
                }
                std::env::set_var(&vars[0].0, &vars[0].1);
                // clap reads a flag's variable when the command is built: build it again.
                let parsed = only_own_flags(command_at(&path)).try_get_matches_from(["t"]);
                std::env::remove_var(&vars[0].0);
                match parsed {
                    Ok(m) => {
                        let raw: Vec<OsString> = m
                            .get_raw(arg.get_id().as_str())
                            .map(|r| r.map(ToOwned::to_owned).collect())
                            .unwrap_or_default();
                        if m.value_source(arg.get_id().as_str())
                            != Some(clap::parser::ValueSource::EnvVariable)
                            || raw != cli_raw
                        {
                            problems.push(format!(
                                "{here} --{long}: from the config file {raw:?}, on the command line {cli_raw:?}"
                            ));
                        } else {
                            checked += 1;
                        }
                    }
                    Err(e) => problems.push(format!("{here} --{long}: from the config file: {e}")),
                }
            }
        }
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        assert!(checked > 100, "only {checked} flags");
        println!("{checked} flags checked");
    }
}
