from coursekit.cli import main

raise SystemExit(main())
