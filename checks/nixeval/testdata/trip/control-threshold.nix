# want: services.nixcage.control.threshold = 2 but control.keys lists 1 key(s)
{ services.nixcage.control = { keys = [ "/etc/nixcage/control/ops.pub" ]; threshold = 2; }; }
