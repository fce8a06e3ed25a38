from trainbook.cli import main

main()
