# Turns (docs/relay.md): a scripted agent's turnCommand and turnTimeout
# reach the model as turn_command and turn_timeout, and validate in Go.
{
  services.nixcage = {
    enable = true;
    agents.helper = {
      command = [ "/bin/sleep" "infinity" ];
      turnCommand = [ "/workspace/bin/turn" "--once" ];
      turnTimeout = "90s";
    };
  };
}
