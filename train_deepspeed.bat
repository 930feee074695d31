@echo off
rem Train with DeepSpeed on Windows: a single GPU, no NCCL. Extra arguments go to
rem launch_deepspeed.py, e.g.   train_deepspeed.bat --bf16 --epochs 30
python "%~dp0launch_deepspeed.py" --num_gpus 1 %*
exit /b %ERRORLEVEL%
