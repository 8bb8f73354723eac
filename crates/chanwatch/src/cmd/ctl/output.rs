//! How `ctl` prints: the `-o table|wide|json|yaml` choice, tables (comfy-table, no padding
//! by hand), the natural order of channel names, and writing to a stdout that may close
//! early (`ctl channels | head -1` ends quietly, no panic).
//!
//! Owns: formatting only. Must not: read the store or the network (callers hand it rows).

use std::io::Write;

use anyhow::{Context, Result};
use clap::{Args as ClapArgs, ValueEnum};
use comfy_table::{Cell, CellAlignment, ColumnConstraint, ContentArrangement, Table};
use serde::Serialize;

pub use chanwatch_core::natural;

/// An output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Format {
    /// Columns for a person.
    #[default]
    Table,
    /// The table with more columns (channels: vchannel, checkpoint position, epoch, age).
    Wide,
    /// JSON, every field.
    Json,
    /// YAML, the same fields as JSON.
    Yaml,
}

/// The output flags every `ctl` command takes (global: before or after the subcommand).
#[derive(Debug, Clone, ClapArgs)]
pub struct OutputArgs {
    /// Output format of commands that print data.
    #[arg(
        short = 'o',
        long = "output",
        env = "CHANWATCH_CTL_OUTPUT",
        value_enum,
        default_value_t,
        global = true
    )]
    output: Format,
    /// Same as `-o json` (kept for scripts written before `-o`).
    #[arg(long, env = "CHANWATCH_CTL_JSON", hide = true, global = true)]
    json: bool,
}

impl OutputArgs {
    /// The format asked for: `--json` wins over `-o`.
    pub fn format(&self) -> Format {
        if self.json {
            Format::Json
        } else {
            self.output
        }
    }
}

/// `value` as the machine format asked for (`None` for table and wide).
///
/// # Errors
/// The value does not serialize (a bug).
pub fn machine<T: Serialize + ?Sized>(format: Format, value: &T) -> Result<Option<String>> {
    Ok(match format {
        Format::Json => Some(serde_json::to_string_pretty(value)? + "\n"),
        Format::Yaml => Some(serde_yaml_ng::to_string(value)?),
        Format::Table | Format::Wide => None,
    })
}

/// A table with `header`; columns whose index is in `right` are right-aligned.
pub struct Columns {
    table: Table,
}

impl Columns {
    /// A table in kubectl's plain style: no borders, two spaces between columns, never
    /// wrapped or cut (a long channel name widens its column instead of breaking it).
    pub fn new(header: &[&str], right: &[usize]) -> Self {
        let mut table = Table::new();
        table
            .load_preset(comfy_table::presets::NOTHING)
            .set_content_arrangement(ContentArrangement::Disabled)
            .set_header(header.iter().enumerate().map(|(i, h)| {
                let cell = Cell::new(h);
                if right.contains(&i) {
                    cell.set_alignment(CellAlignment::Right)
                } else {
                    cell
                }
            }));
        for (i, col) in table.column_iter_mut().enumerate() {
            col.set_padding((0, 2));
            col.set_constraint(ColumnConstraint::ContentWidth);
            if right.contains(&i) {
                col.set_cell_alignment(CellAlignment::Right);
            }
        }
        Columns { table }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.table.add_row(cells);
    }

    /// The table, each line without trailing blanks, ending in a newline.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for line in self.table.lines() {
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Writes `text` to stdout. A reader that went away (`| head -1`) is not an error: the
/// command ends quietly, as `ls | head -1` does.
///
/// # Errors
/// Any other write error.
pub fn emit(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing to stdout"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_cell_widens_its_column_and_lines_carry_no_trailing_blanks() {
        let long = "c".repeat(60);
        let mut t = Columns::new(&["CHANNEL", "EPOCH"], &[1]);
        t.row(vec![long.clone(), "7".into()]);
        t.row(vec!["short".into(), "12".into()]);
        let out = t.render();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(lines[1].starts_with(&long), "{out}");
        assert!(lines.iter().all(|l| !l.ends_with(' ')), "{out:?}");
        // Right-aligned: the epochs end in the same column.
        assert_eq!(lines[1].len(), lines[2].len(), "{out}");
    }
}
