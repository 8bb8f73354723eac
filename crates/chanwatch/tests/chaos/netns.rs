//! A network namespace for one node process of the chaos run, whose traffic to etcd can be
//! dropped with iptables (a network partition: packets vanish, connections hang, nothing
//! errors at once).
//!
//! Layout: namespace `cwchaos{pid}`, a veth pair with the host end `10.213.X.1/30` (etcd also
//! serves clients there, see `ClusterOptions::extra_client_hosts`) and the namespace end
//! `10.213.X.2/30`. A partition inserts `DROP` rules for TCP to and from the host end in the
//! namespace's `OUTPUT` and `INPUT` chains; healing deletes them.
//!
//! Needs root, `ip` (iproute2) and `iptables`; [`Netns::create`] says which is missing. The
//! guard deletes the namespace and the veth pair on drop (also when the test panics).

use std::process::Command;

/// A network namespace with a veth pair into it; removed on drop.
pub struct Netns {
    name: String,
    host_if: String,
    /// The host end's address: what processes in the namespace use to reach etcd.
    pub host_ip: String,
    cut: bool,
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("cannot run `{}`: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    /// Creates the namespace and the veth pair, and checks that iptables works inside.
    ///
    /// # Errors
    /// Why not (not root, no `ip`, no `iptables`, no veth support), to be printed.
    pub fn create() -> Result<Self, String> {
        run(&["ip", "-V"]).map_err(|e| format!("{e} (install iproute2)"))?;
        run(&["iptables", "--version"]).map_err(|e| format!("{e} (install iptables)"))?;
        let pid = std::process::id();
        let x = pid % 250 + 1;
        let ns = Netns {
            name: format!("cwchaos{pid}"),
            host_if: format!("cwc{pid}h"),
            host_ip: format!("10.213.{x}.1"),
            cut: false,
        };
        let ns_if = format!("cwc{pid}n");
        let host_cidr = format!("{}/30", ns.host_ip);
        let ns_cidr = format!("10.213.{x}.2/30");
        let name = ns.name.as_str();
        run(&["ip", "netns", "add", name])?;
        run(&[
            "ip",
            "link",
            "add",
            &ns.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &ns_if,
        ])?;
        run(&["ip", "link", "set", &ns_if, "netns", name])?;
        run(&["ip", "addr", "add", &host_cidr, "dev", &ns.host_if])?;
        run(&["ip", "link", "set", &ns.host_if, "up"])?;
        let exec = ["ip", "netns", "exec", name];
        let inside = |args: &[&str]| run(&[&exec[..], args].concat());
        inside(&["ip", "addr", "add", &ns_cidr, "dev", &ns_if])?;
        inside(&["ip", "link", "set", &ns_if, "up"])?;
        inside(&["ip", "link", "set", "lo", "up"])?;
        inside(&["iptables", "-S"])?;
        Ok(ns)
    }

    /// The command prefix that runs a program inside the namespace (`ip netns exec` execs it,
    /// so the child's pid is the program's).
    pub fn exec_prefix(&self) -> [&str; 4] {
        ["ip", "netns", "exec", &self.name]
    }

    fn rules(&self, op: &str) -> Result<(), String> {
        let exec = self.exec_prefix();
        for (chain, dir) in [("OUTPUT", "-d"), ("INPUT", "-s")] {
            run(&[
                &exec[..],
                &[
                    "iptables",
                    op,
                    chain,
                    "-p",
                    "tcp",
                    dir,
                    &self.host_ip,
                    "-j",
                    "DROP",
                ],
            ]
            .concat())?;
        }
        Ok(())
    }

    /// Drops every TCP packet between the namespace and etcd.
    ///
    /// # Errors
    /// When iptables refuses.
    pub fn cut(&mut self) -> Result<(), String> {
        self.rules("-I")?;
        self.cut = true;
        Ok(())
    }

    /// Lets the packets through again.
    ///
    /// # Errors
    /// When iptables refuses.
    pub fn heal(&mut self) -> Result<(), String> {
        if self.cut {
            self.rules("-D")?;
            self.cut = false;
        }
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = self.heal();
        let _ = run(&["ip", "netns", "del", &self.name]);
        let _ = run(&["ip", "link", "del", &self.host_if]);
    }
}
