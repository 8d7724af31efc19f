# Signed tool releases: apply verifies and switches generations atomically;
# an older generation (rollback attack), an unsigned or foreign-signed
# release and a tampered NAR are refused with the store unchanged; the
# explicit `cagectl rollback` is the only way back.
{ self }:
let
  common = import ./lib/common.nix { inherit self; };
in
{
  name = "signed-apply";
  nodes.machine = {
    imports = [ common.machine ];
    services.nixcage.agents.tools = common.agent "/nix/tools/bin/curl --version > /workspace/version";
  };

  testScript = ''
    ${common.prelude}
    current = lambda: machine.succeed("readlink /var/lib/nixcage/store/current").strip()

    with subtest("a newer signed generation is applied"):
        gen1 = current()
        machine.succeed("publish 2")
        gen2 = current()
        assert gen1 != gen2, (gen1, gen2)
        machine.succeed("cagectl generations | grep -q 2")

    with subtest("the agent runs tools from the current generation"):
        machine.succeed("systemctl start nixcage-agent@tools.service")
        machine.wait_until_succeeds("grep -q curl /var/lib/nixcage/agents/tools/version")

    with subtest("an older generation is refused (anti-rollback)"):
        out = machine.fail("publish 1 2>&1")
        assert "generation" in out, out
        assert current() == gen2

    with subtest("a release signed by an untrusted key is refused"):
        machine.succeed("cagectl key generate --out /tmp/mallory")
        machine.fail("publish 3 /tmp/mallory")
        assert current() == gen2

    with subtest("a tampered NAR is refused"):
        machine.succeed("cagectl release create $(readlink -f /var/lib/nixcage/store/current) --key /var/lib/nixcage-test/release.key --channel stable --generation 4 --expires 30d --out /tmp/r4")
        machine.succeed("f=$(ls /tmp/r4/nar/* | head -1); chmod u+w $f; printf x >> $f")
        machine.fail("cagectl apply /tmp/r4")
        assert current() == gen2

    with subtest("explicit rollback is the way back, and is logged"):
        machine.succeed("cagectl rollback")
        assert current() == gen1
        machine.succeed("journalctl -u nixcage-caged.service | grep -qi rollback")
  '';
}
