# want: Credential host not allowed
{
  services.nixcage = {
    enable = true;
    agents.a = {
      backend = "service"; command = [ "/bin/true" ];
      egress = "claude-code";
      secrets.anthropic = { source = "/run/secrets/anthropic"; env = "ANTHROPIC_API_KEY"; hosts = [ "api.openai.com" ]; };
    };
  };
}
