package render

// Hardening shared by nixcage's own services. Each unit starts from
// baseHardening and adds or loosens only what its job needs; the reason for
// every loosening is written where it happens. Scores are checked by
// TestSecurityScores with `systemd-analyze security --offline=true`.
func baseHardening() []string {
	return []string{
		"NoNewPrivileges", "yes",
		"ProtectSystem", "strict",
		"ProtectHome", "yes",
		"PrivateTmp", "yes",
		"PrivateDevices", "yes",
		"ProtectKernelTunables", "yes",
		"ProtectKernelModules", "yes",
		"ProtectKernelLogs", "yes",
		"ProtectControlGroups", "yes",
		"ProtectClock", "yes",
		"ProtectHostname", "yes",
		"ProtectProc", "invisible",
		"ProcSubset", "pid",
		"RestrictNamespaces", "yes",
		"RestrictRealtime", "yes",
		"RestrictSUIDSGID", "yes",
		"LockPersonality", "yes",
		"SystemCallArchitectures", "native",
		"UMask", "0077",
		"KeyringMode", "private",
		"RemoveIPC", "yes",
	}
}

// unprivilegedHardening is what the gateway and the relay, the two
// nixcage services that talk to the internet as a user of their own, add
// to baseHardening: no capabilities at all, the system-service syscalls
// minus what no nixcage process needs, W^X memory, no devices.
func unprivilegedHardening() []string {
	return []string{
		"PrivateUsers", "yes",
		"RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6",
		// Belt and braces under the gateway's own address checks: the kernel
		// refuses link-local (cloud metadata) and multicast for this unit.
		"IPAddressDeny", "link-local multicast",
		"CapabilityBoundingSet", "",
		"AmbientCapabilities", "",
		"SystemCallFilter", "@system-service",
		"SystemCallFilter", denySyscalls + " @resources",
		"SystemCallErrorNumber", "EPERM",
		"MemoryDenyWriteExecute", "yes",
		"DevicePolicy", "closed",
	}
}

// Syscall groups no nixcage process or agent has a use for. ptrace (@debug),
// mount, module loading, raw I/O and reboot are what an escaping agent would
// want first. io_uring is in @system-service, and its opcodes (socket,
// connect, openat...) bypass per-syscall filters such as
// RestrictAddressFamilies= (issue 16).
const denySyscalls = "~@clock @cpu-emulation @debug @module @mount @obsolete @privileged @raw-io @reboot @swap " + ioURing

// ioURing are the io_uring system calls.
const ioURing = "io_uring_setup io_uring_enter io_uring_register"

// sealFamilies are the socket address families an nspawn or podman cage may
// open: RestrictAddressFamilies= of those units and internal/seal's filter
// (TestSealFamilies keeps the two equal). Service cages get these without
// AF_NETLINK, which only the container managers need.
var sealFamilies = []string{"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
