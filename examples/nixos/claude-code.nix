# docs/examples/claude-code.hcl as a NixOS module: Claude Code and Codex
# under their shipped harnesses (docs/harnesses.md), the API keys from
# sops-nix. Each secret takes its hosts and header from the policy's
# credential block and its variable from the harness.
{ config, lib, ... }:
{
  # sops.secrets.anthropic-api-key = { sopsFile = ./secrets.yaml; };
  services.nixcage = {
    enable = true;

    agents.claude = {
      backend = "service";
      harness = "claude-code";
      command = [ "/nix/tools/bin/claude" "--print" "--permission-mode" "bypassPermissions" "summarize README.md" ];
      secrets.anthropic = {
        # config.sops.secrets.anthropic-api-key.path when sops-nix is imported.
        source = lib.attrByPath [ "sops" "secrets" "anthropic-api-key" "path" ] "/run/secrets/anthropic-api-key" config;
      };
      resources = {
        memory = "4G";
        cpu = "200%";
        tasks = 1024;
      };
    };

    agents.codex = {
      backend = "service";
      harness = "codex";
      command = [ "/nix/tools/bin/codex" "exec" "--skip-git-repo-check" "summarize README.md" ];
      secrets.openai.source = lib.attrByPath [ "sops" "secrets" "openai-api-key" "path" ] "/run/secrets/openai-api-key" config;
    };

    accounts.admins = {
      group = "wheel";
      role = "admin";
    };
  };
}
