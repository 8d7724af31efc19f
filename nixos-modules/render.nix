# The one renderer: the declaration (or configFile) goes through the packaged
# `cagectl validate` and `cagectl render` in a derivation, exactly as
# `cagectl render cage.hcl --out /etc` does on any systemd host. No unit is
# written in Nix; this file only decides where NixOS picks the files up.
{ config, lib, pkgs, ... }:
let
  cfg = config.services.nixcage;
  pkg = cfg.package;
  systemd = config.systemd.package;

  # The name must end in .json: the loader picks HCL's JSON syntax by suffix.
  source =
    if cfg.configFile != null then cfg.configFile
    else (pkgs.formats.json { }).generate "nixcage.json" cfg.model;

  # Only podman agents reference it, and asserts.nix requires
  # virtualisation.podman.enable for them; no podman in the closure otherwise.
  podman =
    if config.virtualisation.podman.enable then "${config.virtualisation.podman.package}/bin/podman"
    else "/run/current-system/sw/bin/podman";

  rendered = pkgs.runCommand "nixcage-rendered" { nativeBuildInputs = [ pkg ]; } ''
    # A bad declaration fails nixos-rebuild here, with the Go diagnostics,
    # not at boot (the sops-nix pattern).
    cagectl validate ${source}
    cagectl render ${source} --out $out/etc --prefix /etc --bindir ${pkg}/bin \
      --ip ${pkgs.iproute2}/bin/ip \
      --nspawn ${systemd}/bin/systemd-nspawn \
      --podman ${podman} \
      --tmpfiles ${systemd}/bin/systemd-tmpfiles

    mkdir -p $out/etc/nixcage/agents  # environment.etc needs it even without agents

    # NixOS ignores .wants/ directories of systemd.packages; keep the
    # renderer's autostart decision as a Wants= drop-in instead.
    wants=$out/etc/systemd/system/nixcage.target.wants
    if [ -d "$wants" ]; then
      mkdir -p $out/etc/systemd/system/nixcage.target.d
      {
        echo "# From cagectl render's nixcage.target.wants/."
        echo "[Unit]"
        for u in "$wants"/*; do echo "Wants=$(basename "$u")"; done
      } > $out/etc/systemd/system/nixcage.target.d/50-autostart.conf
      rm -r "$wants"
    fi

    # systemd.tmpfiles.packages reads lib/tmpfiles.d.
    mkdir -p $out/lib/tmpfiles.d
    mv $out/etc/tmpfiles.d/nixcage.conf $out/lib/tmpfiles.d/
    rmdir $out/etc/tmpfiles.d
  '';
in
{
  options.services.nixcage.rendered = lib.mkOption {
    type = lib.types.package;
    readOnly = true;
    description = "The rendered tree (etc/systemd/system, etc/nixcage, etc/dbus-1, lib/tmpfiles.d), for inspection: nix build .#nixosConfigurations.HOST.config.services.nixcage.rendered";
  };

  config = lib.mkMerge [
    { services.nixcage.rendered = rendered; }
    (lib.mkIf cfg.enable {
      environment.systemPackages = [ pkg ];
      systemd.packages = [ rendered ];
      systemd.tmpfiles.packages = [ rendered ];
      services.dbus.packages = [ rendered ];
      # File by file, so the operator can still put e.g. release keys in
      # /etc/nixcage with environment.etc.
      environment.etc."nixcage/nixcage.json".source = "${rendered}/etc/nixcage/nixcage.json";
      environment.etc."nixcage/agents".source = "${rendered}/etc/nixcage/agents";
      # The options the units were rendered with: caged renders each turn's
      # unit like its agent's (docs/relay.md).
      environment.etc."nixcage/render-options.json".source = "${rendered}/etc/nixcage/render-options.json";
      # [Install] sections of packaged units are not read by NixOS.
      systemd.targets.nixcage.wantedBy = [ "multi-user.target" ];
    })
    # The chat relay runs as a declared system user (docs/relay.md says
    # why); its unit comes from the rendered tree like every other.
    (lib.mkIf (cfg.enable && cfg.relay != null) {
      users.users.cage-relay = { isSystemUser = true; group = "cage-relay"; description = "nixcage chat relay"; };
      users.groups.cage-relay = { };
      environment.etc."nixcage/relay.json".source = "${rendered}/etc/nixcage/relay.json";
      systemd.services.cage-relay.wantedBy = [ "multi-user.target" ];
    })
  ];
}
