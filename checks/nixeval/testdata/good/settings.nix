# settings reaches schema fields the options do not declare; here it sets
# fields the options do declare too, and wins (merged last).
{
  services.nixcage = {
    enable = true;
    agents.a = { backend = "service"; command = [ "/bin/true" ]; autostart = true; };
    settings.agent.a = { autostart = false; tools = "claude-1.0"; };
  };
}
