# Status over D-Bus: caged owns org.nixcage.cage1 on the system bus (the
# module installed the rendered policy), introspection works, any local user
# reads status, only root may own the name.
{ self }:
let
  common = import ./lib/common.nix { inherit self; };
in
{
  name = "status-dbus";
  nodes.machine = {
    imports = [ common.machine ];
    services.nixcage.agents.idle = common.agent "exec /nix/tools/bin/sleep infinity";
  };

  testScript = ''
    ${common.prelude}
    machine.succeed("systemctl start nixcage-agent@idle.service")

    with subtest("the bus policy is installed and caged owns the name"):
        # services.dbus.packages adds the rendered tree's etc/dbus-1/system.d.
        machine.succeed("grep -q 'nixcage-rendered/etc/dbus-1/system.d' /etc/dbus-1/system.conf")
        machine.succeed("busctl --system status org.nixcage.cage1")
        machine.succeed("busctl introspect org.nixcage.cage1 /org/nixcage/cage1 | grep -q org.nixcage.cage1.Manager")

    with subtest("any local user reads status"):
        out = machine.succeed("su - mallory -c 'cagectl status'")
        assert "idle" in out, out

    with subtest("day-two verbs say what NixOS does instead"):
        # The twin of checks/system TestApplyConfigAndRotateSecret: on NixOS
        # the units belong to the system generation.
        out = machine.fail("cagectl apply-config /etc/nixcage/nixcage.json 2>&1")
        assert "nixos-rebuild switch" in out, out
        out = machine.succeed("cagectl --version && cagectl status")
        assert "cagectl 0.1.0" in out and "caged 0.1.0" in out, out

    with subtest("nobody else may own the name"):
        machine.fail("su - mallory -c 'busctl --system call org.freedesktop.DBus /org/freedesktop/DBus org.freedesktop.DBus RequestName su org.nixcage.cage1 0' | grep -q '^u 1'")
  '';
}
